"""Started first by every Python process the test suite spawns (tests/conftest.py puts this folder on their
PYTHONPATH): it hides torch, as a user's install has none (`pip install -e .` does not bring it).

The test venv holds torch for the parity test alone, and transformers imports it whenever it is installed: a
node process importing mlx-lm and mlx-vlm then pays about 11 s of CPU instead of 3. A module set to None in
sys.modules is one `import` refuses and `importlib.util.find_spec` reports absent, which is how transformers asks.

Two speed-ups of the suite, not what a user's install has: OpenBLAS under MLX, as the workers have it
(tools/harness/blas.py; a node's output is compared with mlx-lm's under the same BLAS either way), and
transformers' lazy import table read from the run's copy instead of walked anew (tools/harness/transformers_table.py).
"""

import os
import sys
import time

sys.modules.setdefault("torch", None)


def _harness(name: str):
    """tools/harness/<name>.py, loaded by path: the repository is not on every child's sys.path."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"_tests_{name}", Path(__file__).resolve().parents[1] / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_harness("blas").use_openblas()  # MLX's float32 matmuls on OpenBLAS, as in the workers
_harness("transformers_table").install()  # transformers' import table built once per run

if _log := os.environ.get("TESTS_PROCESS_LOG"):
    # What the suite starts, to see where its time goes: TESTS_PROCESS_LOG=FILE appends one line a Python process
    # (its start time, pid and command line).
    with open(_log, "a") as f:
        f.write(f"{time.time():.3f} {os.getpid()} {' '.join(sys.orig_argv[1:])[:300]}\n")
