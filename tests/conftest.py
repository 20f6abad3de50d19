import os
from pathlib import Path

import pytest

from provider import logs
from tools.fixtures import factory


def _run_root(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this run shares (the workers' base temps' parent), so that
    what takes seconds to build (distilled heads) is built once per run instead of once per worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _built_once(out: Path, build) -> Path:
    """`build()` into `out` unless a worker has finished it: under a lock, with a marker written last."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out.parent / f"{out.name}.built").exists():
            build()
            (out.parent / f"{out.name}.built").touch()
    return out


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory) -> Path:
    """Every fixture checkpoint, built once per test run with the real factory."""
    root = _run_root(tmp_path_factory) / "fixtures"
    return _built_once(root, lambda: factory.write_all(root))


@pytest.fixture(scope="session")
def head_fixture(tmp_path_factory):
    """head_fixture(name): a target with its own MTP head (fixtures.mtp.HEAD_FIXTURES), built when first asked."""
    from tools.fixtures.mtp import build_head_fixture

    root = _run_root(tmp_path_factory) / "heads"
    return lambda name: _built_once(root / name, lambda: build_head_fixture(name, root))


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
