import os
from pathlib import Path

import pytest

from provider import logs
from provider.models import fixtures


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory) -> Path:
    """Every fixture checkpoint, built once per test session with the real factory."""
    root = tmp_path_factory.mktemp("fixtures")
    fixtures.write_all(root)
    return root


@pytest.fixture(scope="session")
def head_fixture(tmp_path_factory):
    """head_fixture(name): a target with its own MTP head (fixtures_mtp.HEAD_FIXTURES), built when first asked."""
    from provider.models.fixtures_mtp import build_head_fixture

    root = tmp_path_factory.mktemp("heads")
    return lambda name: build_head_fixture(name, root)


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
