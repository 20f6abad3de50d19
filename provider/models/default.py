"""The bundled default model of `provider start --local`: available with no network."""

from __future__ import annotations

from pathlib import Path

from .. import paths
from . import fixtures

DEFAULT_MODEL_NAME = "gemma4-tiny"


def ensure_default_model() -> Path:
    """Path to the default model, building it locally on first use."""
    root = paths.cache_dir() / "models"
    target = root / DEFAULT_MODEL_NAME
    if not (target / "model.safetensors").exists():
        fixtures.FIXTURES[DEFAULT_MODEL_NAME](root)
    return target


def default_pair() -> tuple[Path, Path | None]:
    """The bundled target and its drafter (None until a trained pair ships)."""
    return ensure_default_model(), None
