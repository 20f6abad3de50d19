import ast
import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from tools.harness import blas

BLAS = blas.use_openblas()  # before anything imports MLX: it binds its BLAS when it loads

from provider import logs  # noqa: E402
from tools.fixtures import factory  # noqa: E402


def _run_root(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this run shares (the workers' base temps' parent), so that
    what takes seconds to build (distilled heads) is built once per run instead of once per worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


REPO = Path(__file__).resolve().parents[1]
AS_INSTALLED = REPO / "tools" / "harness" / "as_installed"
# What a distilled head is made from: the fixture modules, the drafters' code they train and what else of the product
# they import (a change to any builds them anew), beside MLX's and mlx-lm's versions.
FIXTURE_SOURCES = ("tools/fixtures/**/*.py", "provider/drafters/**/*.py", "provider/proofs/hidden_tap.py",
                   "provider/memory/estimate.py")
NOT_HEAD_SOURCES = ("tools/fixtures/demo_f32.py",)  # built per run, and no head imports it
KEEP_OTHER_KEYS_S = 7 * 86400  # caches of other sources left this long untouched are removed


def _fixture_key() -> str:
    import mlx.core as mx
    import mlx_lm

    # Not the BLAS (tools/harness/blas.py): another one's float32 sums differ in their last bits, and a head distilled
    # under either is as good a fixture (every test compares the node with mlx-lm on the same bytes).
    h = hashlib.sha256(f"mlx {mx.__version__} mlx-lm {mlx_lm.__version__}".encode())
    for pattern in FIXTURE_SOURCES:
        for f in sorted(REPO.glob(pattern)):
            if f.relative_to(REPO).as_posix() in NOT_HEAD_SOURCES:
                continue
            h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + _code_of(f.read_bytes(), str(f)).encode())
    return h.hexdigest()[:16]


def _code_of(source: bytes, name: str) -> str:
    """A module's code without its comments and docstrings: editing, adding or removing what a module says of itself
    builds no head anew (the distilled bytes depend on the code alone). A file that does not parse is keyed by its
    text: the tests importing it report the error, not every test's set-up."""
    try:
        tree = ast.parse(source, filename=name)
    except SyntaxError:
        return source.decode("utf-8", "replace")
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[:] = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _kept_root() -> Path | None:
    """Where distilled heads outlive the run (they take 30-120 s each to distil, and a clean clone of the same
    sources builds the same bytes): $XDG_CACHE_HOME/provider-node-tests/<key>, or PROVIDER_TEST_FIXTURES (a
    directory, or "off" to build them per run). Read at import, before tests isolate XDG_CACHE_HOME."""
    where = os.environ.get("PROVIDER_TEST_FIXTURES", "")
    if where == "off":
        return None
    base = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "provider-node-tests"
    root = base / _fixture_key()
    if not root.exists():
        for other in base.glob("*"):  # another version's, long unused
            if other.is_dir() and time.time() - other.stat().st_mtime > KEEP_OTHER_KEYS_S:
                shutil.rmtree(other, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    os.utime(root)
    return root


KEPT_ROOT = _kept_root()


def _built_once(out: Path, build) -> Path:
    """`build()` into `out` unless a worker (of this run, or of an earlier one where `out` is kept) has finished
    it: under a lock, with a marker written last; what an interrupted build left is removed first."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out.parent / f"{out.name}.built").exists():
            shutil.rmtree(out, ignore_errors=True)
            build()
            (out.parent / f"{out.name}.built").touch()
    return out


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory) -> Path:
    """Every fixture checkpoint, built once per test run with the real factory."""
    root = _run_root(tmp_path_factory) / "fixtures"
    return _built_once(root, lambda: factory.write_all(root))


@pytest.fixture(scope="session")
def demo_f32(tmp_path_factory) -> tuple[Path, Path]:
    """(target, assistant): the bundled demo pair in float32 (tools/fixtures/demo_f32.py), built once per run."""
    from tools.fixtures.demo_f32 import write_demo_f32

    root = _run_root(tmp_path_factory) / "demo-f32"
    _built_once(root, lambda: write_demo_f32(root))
    return root / "gemma4-demo", root / "gemma4-demo-assistant"


@pytest.fixture(scope="session")
def head_fixture(tmp_path_factory):
    """head_fixture(name): a target with its own MTP head (fixtures.mtp.HEAD_FIXTURES), built when first asked."""
    from tools.fixtures.mtp import build_head_fixture

    root = KEPT_ROOT / "heads" if KEPT_ROOT is not None else _run_root(tmp_path_factory) / "heads"
    return lambda name: _built_once(root / name, lambda: build_head_fixture(name, root))


@pytest.fixture(scope="session", autouse=True)
def _children_as_installed(tmp_path_factory):
    """Every process a test starts runs without torch, as a user's install does (tools/harness/as_installed), and
    shares this run's copy of transformers' import table (tools/harness/transformers_table.py). Set where tests run
    (a worker, or the one process without xdist), never in the xdist controller: the workers keep torch for the
    parity test."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(AS_INSTALLED), os.environ.get("PYTHONPATH")]))
    os.environ["TESTS_TRANSFORMERS_TABLE"] = str(_run_root(tmp_path_factory) / "transformers-table")


@pytest.fixture(autouse=True)
def _isolated_xdg(tmp_path, monkeypatch):
    """Keep tokens, keys and caches of every test out of the real home directory."""
    for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key in list(os.environ):
        if key.startswith("PROVIDER_"):
            monkeypatch.delenv(key)
    logs.configure("warning", "json")


def pytest_collection_modifyitems(items):
    """Tests marked `heavy` (minutes, one core) run first, so with the suite spread over the cores
    (pytest-xdist) the rest of it runs beside them instead of after them."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
