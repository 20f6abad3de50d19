"""The resident set: model id -> loaded model, loaded on first use.

Only the engine thread calls `acquire`/`release` (it owns MLX); front ends
call `ids`/`canonical_id` to validate requests without touching MLX.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ..jobs import Cause, JobError
from . import loader
from .loader import LoadedModel


class ModelManager:
    def __init__(self, sources: dict[str, str], default_id: str | None = None):
        """`sources` maps public model id -> a directory or Hugging Face repo id."""
        self._sources = dict(sources)
        self.default_id = default_id or next(iter(self._sources), None)
        self._resident: dict[str, LoadedModel] = {}
        self._in_use: dict[str, int] = {}
        self._lock = threading.Lock()  # guards the dicts for readers on other threads

    def ids(self) -> list[str]:
        return list(self._sources)

    def canonical_id(self, name: str | None) -> str:
        """Map a requested model name (id, source path, or empty for the default) to a known id."""
        if not name:
            if self.default_id is None:
                raise JobError(Cause.UNKNOWN_MODEL, "no model is configured on this node")
            return self.default_id
        if name in self._sources:
            return name
        for mid, src in self._sources.items():
            if name == src:
                return mid
        raise JobError(Cause.UNKNOWN_MODEL, f"model {name!r} is not served here; available: {', '.join(self._sources)}")

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._resident)

    def acquire(self, model_id: str) -> LoadedModel:
        model_id = self.canonical_id(model_id)
        with self._lock:
            lm = self._resident.get(model_id)
        if lm is None:
            lm = loader.load(model_id, loader.resolve(self._sources[model_id]))
            with self._lock:
                self._resident[model_id] = lm
        with self._lock:
            self._in_use[model_id] = self._in_use.get(model_id, 0) + 1
        lm.last_used = time.monotonic()
        return lm

    def release(self, model_id: str) -> None:
        with self._lock:
            self._in_use[model_id] -= 1
            if model_id in self._resident:
                self._resident[model_id].last_used = time.monotonic()

    @staticmethod
    def source_path(source: str) -> Path | None:
        p = Path(source).expanduser()
        return p if p.is_dir() else None
