"""Started first by every Python process the test suite spawns (tests/conftest.py puts this folder on their
PYTHONPATH): it hides torch, as a user's install has none (`pip install -e .` does not bring it).

The test venv holds torch for the parity test alone, and transformers imports it whenever it is installed: a
node process importing mlx-lm and mlx-vlm then pays about 11 s of CPU instead of 3. A module set to None in
sys.modules is one `import` refuses and `importlib.util.find_spec` reports absent, which is how transformers asks.

It also puts OpenBLAS under MLX, as the workers have it (tools/harness/blas.py): a speed-up of the suite, not what a
user's install has; a node's output is compared with mlx-lm's under the same BLAS either way.
"""

import os
import sys
import time

sys.modules.setdefault("torch", None)


def _use_openblas() -> None:
    """MLX's float32 matmuls on OpenBLAS, as in the workers (tools/harness/blas.py; loaded by path: the repository
    is not on every child's sys.path)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_tests_blas", Path(__file__).resolve().parents[1] / "blas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.use_openblas()


_use_openblas()

if _log := os.environ.get("TESTS_PROCESS_LOG"):
    # What the suite starts, to see where its time goes: TESTS_PROCESS_LOG=FILE appends one line a Python process
    # (its start time, pid and command line).
    with open(_log, "a") as f:
        f.write(f"{time.time():.3f} {os.getpid()} {' '.join(sys.orig_argv[1:])[:300]}\n")
