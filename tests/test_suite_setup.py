"""What the suite sets up for every process it runs (tests/conftest.py, tools/harness/as_installed): a child
without torch, as a user's install is, and MLX's float32 matmuls on OpenBLAS where the machine has it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import BLAS, REPO

CHILD = textwrap.dedent("""
    import importlib.util, json, sys
    import mlx.core
    maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
    print(json.dumps({"torch": importlib.util.find_spec("torch") is not None, "openblas": "libopenblas" in maps}))
""")


def test_a_child_has_no_torch_and_the_same_blas_as_its_worker():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, cwd=REPO)
    child = json.loads(out.stdout)
    assert child["torch"] is False
    assert child["openblas"] == BLAS.startswith("openblas")


def test_the_worker_runs_mlx_on_openblas_where_ci_installs_it():
    assert BLAS != "too late", "something imported MLX before tests/conftest.py could load OpenBLAS under it"
    if not sys.platform.startswith("linux"):
        pytest.skip("OpenBLAS is loaded on Linux only (macOS has Accelerate)")
    if BLAS == "reference" and (os.environ.get("TESTS_BLAS") == "reference" or not os.environ.get("CI")):
        pytest.skip("no OpenBLAS on this machine, or TESTS_BLAS=reference (.ci/run installs libopenblas0-pthread)")
    assert BLAS.startswith("openblas"), "no OpenBLAS in CI: .ci/run could not install libopenblas0-pthread"
    import mlx.core as mx

    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))
    with open("/proc/self/maps") as f:
        assert "libopenblas" in f.read()


def test_children_share_transformers_import_table_as_transformers_builds_it():
    """A child reads the run's copy of the table (tools/harness/transformers_table.py), and the copy is the table
    transformers builds in this process, which walks its files itself."""
    import pickle
    from pathlib import Path

    from transformers.utils import import_utils

    table_dir = Path(os.environ["TESTS_TRANSFORMERS_TABLE"])
    child = "import transformers.utils.import_utils as u, transformers; print(transformers.AutoTokenizer.__name__)"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "AutoTokenizer"
    tables = [pickle.loads(f.read_bytes()) for f in table_dir.glob("*.pickle")]
    assert tables, "no child kept a table"
    for path, table in tables:  # of transformers/models (by its folder and its __init__.py) and what else it read
        assert table == import_utils.create_import_structure_from_path(path), path
