"""The catalog: which models this node serves, by which names, and what their files say; read from disk once.

Nothing here loads weights: `checkpoint` resolves a model's directory (downloading a repo id not yet cached,
when allowed) and reads its config; `facts` adds what the safetensors headers say. Any thread may ask.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..jobs import Cause, JobError
from ..memory import estimate
from ..status import ModelFacts
from . import loader
from .checkpoint import open_checkpoint, read_config
from .store import StoredModel


class Catalog:
    def __init__(self, models: list[StoredModel], *, default_id: str | None = None, allow_download: bool = True):
        self._models = {m.id: m for m in models}
        self.default_id = default_id or next(iter(self._models), None)
        self._allow_download = allow_download

    def ids(self) -> list[str]:
        return list(self._models)

    def stored(self, model_id: str) -> StoredModel:
        return self._models[model_id]

    def canonical_id(self, name: str | None) -> str:
        """Map a requested model name (id, source, or empty for the default) to a known id."""
        if not name:
            if self.default_id is None:
                raise JobError(Cause.UNKNOWN_MODEL, "no model is configured on this node")
            return self.default_id
        if name in self._models:
            return name
        for mid, m in self._models.items():
            if name == m.source:
                return mid
        raise JobError(Cause.UNKNOWN_MODEL, f"model {name!r} is not served here; available: {', '.join(self._models)}")

    def checkpoint(self, model_id: str) -> tuple[Path, dict]:
        """The model's directory and config (downloading it if it is a repo id not yet cached)."""
        stored = self._models[model_id]
        path = stored.path or loader.resolve(stored.source, allow_download=self._allow_download)
        return path, read_config(path)

    def facts(self, model_id: str) -> ModelFacts | None:
        """What the files say the model is; None while not downloaded or when its files cannot be read."""
        stored = self._models[model_id]
        if stored.path is None:
            return None
        try:
            return _facts(stored.path, (stored.path / "config.json").stat().st_mtime_ns)
        except Exception:  # a broken checkpoint is listed without facts; a job for it gets the load error
            return None


@functools.lru_cache(maxsize=256)
def _facts(path: Path, mtime_ns: int) -> ModelFacts:
    from . import capability

    ckpt = open_checkpoint(path)
    caps = capability.detect(path, ckpt.config)
    return ModelFacts(size_bytes=estimate.weight_bytes(ckpt.config, ckpt.tensors), family=caps.family,
                      quantization=caps.quantization, context_length=caps.context_length,
                      native_mtp_heads=caps.native_mtp_heads, vision=caps.vision)
