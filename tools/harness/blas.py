"""OpenBLAS under MLX's CPU backend, for the test suite's processes.

MLX's Linux CPU wheel (mlx-cpu) carries the reference BLAS (netlib), whose sgemm runs a float32 matmul at about
2.6 GFLOP/s here against OpenBLAS's 53 (one thread, 64x1024 @ 1024x1024). The fixtures are float32, so the suite
spends much of its time there. Loading OpenBLAS into the global symbol scope before MLX is imported makes
libmlx's `cblas_sgemm` resolve to it: the same MLX, the same kernels for everything else (float16 and quantized
matmuls are MLX's own and unchanged).

What it changes in what the suite checks: under the reference BLAS a row of a width-k float32 forward equals
the width-1 row bit for bit, so a greedy "speculation (or a batch) equals plain decoding token for token" check
on a float32 fixture held by construction; under OpenBLAS rows of width 4 and more round otherwise (~1e-5 on a
logit), as Metal's kernels do, and such checks hold unless an argmax is that near a tie (none was, in the whole
runs made under it on this machine). The checks that compare a state bit for bit across widths run in a process
of their own on the reference BLAS (test_mtp_nemotron, test_mtp_qwen_moe).

One thread a process: the suite runs one pytest-xdist worker a core, and their daemons beside them.
Not found (macOS, or Linux without Debian's libopenblas0-pthread, which .ci/run installs): nothing changes.
TESTS_BLAS=reference keeps MLX's own (the suite as Linux users' MLX runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

CANDIDATES = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian's, as .ci/run installs it
              "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")


def use_openblas() -> str:
    """Load OpenBLAS globally, once, before MLX: what is in use ("openblas <path>", "reference", or "too late" when
    MLX was imported first and bound the reference one)."""
    if not sys.platform.startswith("linux") or os.environ.get("TESTS_BLAS") == "reference":
        return "reference"
    if "mlx.core" in sys.modules:  # libmlx's symbols are bound
        return "too late"
    path = next((p for p in CANDIDATES if os.path.exists(p)), None) or ctypes.util.find_library("openblas")
    if not path:
        return "reference"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # read when the library loads
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return "reference"
    return f"openblas {path}"
