"""OpenBLAS under MLX's CPU backend, for the test suite's processes.

MLX's Linux CPU wheel (mlx-cpu) carries the reference BLAS (netlib), whose sgemm runs a float32 matmul at about
2.6 GFLOP/s here against OpenBLAS's 53 (one thread, 64x1024 @ 1024x1024). The fixtures are float32, so the suite
spends much of its time there. Loading OpenBLAS into the global symbol scope before MLX is imported makes
libmlx's `cblas_sgemm` resolve to it: the same MLX, the same kernels for everything else (float16 and quantized
matmuls are MLX's own and unchanged).

One thread a process: the suite runs one pytest-xdist worker a core, and their daemons beside them.
Not found (macOS, or Linux without Debian's libopenblas0-pthread, which .ci/run installs): nothing changes.
TESTS_BLAS=reference keeps MLX's own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

CANDIDATES = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
              "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")


def use_openblas() -> str:
    """Load OpenBLAS globally, once, before MLX: what is in use ("openblas <path>" or "reference")."""
    if not sys.platform.startswith("linux") or os.environ.get("TESTS_BLAS") == "reference":
        return "reference"
    if "mlx.core" in sys.modules:  # too late: libmlx's symbols are bound
        return "reference"
    path = next((p for p in CANDIDATES if os.path.exists(p)), None) or ctypes.util.find_library("openblas")
    if not path:
        return "reference"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # read when the library loads
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return "reference"
    return f"openblas {path}"
