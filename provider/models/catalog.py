"""The catalog: which models this node serves, by which names, and what their files say; read from disk once.

Nothing here loads weights: `checkpoint` resolves a model's directory (downloading a repo id not yet cached,
when allowed) and reads its config; `facts` adds what the safetensors headers say. Any thread may ask.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from .. import logs
from ..jobs import JobError
from ..types import Cause, ModelId
from ..memory import estimate
from ..status import ModelFacts
from . import loader, manifest
from ..memory.checkpoint import open_checkpoint, read_config
from .store import StoredModel

log = logs.get("models")


class Catalog:
    def __init__(self, models: list[StoredModel], *, default_id: str | None = None, allow_download: bool = True):
        self._models = {m.id: m for m in models}
        self.default_id = default_id or next(iter(self._models), None)
        self._allow_download = allow_download
        self._hashes: dict[Path, str] = {}  # directory -> manifest hash, as last computed
        self._hash_lock = threading.Lock()

    def ids(self) -> list[str]:
        return list(self._models)

    def stored(self, model_id: str) -> StoredModel:
        return self._models[model_id]

    def canonical_id(self, name: str | None) -> ModelId:
        """Map a requested model name (id, source, or empty for the default) to a known id."""
        if not name:
            if self.default_id is None:
                raise JobError(Cause.UNKNOWN_MODEL, "no model is configured on this node")
            return ModelId(self.default_id)
        if name in self._models:
            return ModelId(name)
        for mid, m in self._models.items():
            if name == m.source:
                return ModelId(mid)
        raise JobError(Cause.UNKNOWN_MODEL, f"model {name!r} is not served here; available: {', '.join(self._models)}")

    def checkpoint(self, model_id: str) -> tuple[Path, dict]:
        """The model's directory and config (downloading it if it is a repo id not yet cached)."""
        stored = self._models[model_id]
        path = stored.path or loader.resolve(stored.source, allow_download=self._allow_download)
        return path, read_config(path)

    def tokenizer_files(self, model_id: str) -> tuple[Path, dict]:
        """The directory holding the model's config and tokenizer, and its config: all a prompt needs. A repo
        not yet cached has only those files fetched, so preparing a prompt never waits on its weights."""
        stored = self._models[model_id]
        path = stored.path or loader.resolve(stored.source, allow_download=self._allow_download,
                                             patterns=loader.TOKENIZER_PATTERNS)
        return path, read_config(path)

    def drafter_path(self, model_id: str) -> Path | None:
        drafter = self._models[model_id].drafter
        return Path(drafter).expanduser() if drafter else None

    def manifest_hash(self, model_id: str, *, drafter: bool = False) -> str:
        """The manifest hash of a model's (or its drafter's) files as they are now, or "" while they are not
        on disk. Blocking: it stats every file and hashes those changed since last time (the manifest cache
        makes a repeat cheap), so call it off the event loop and the engine thread."""
        path = self.drafter_path(model_id) if drafter else self._models[model_id].path
        if path is None or not path.is_dir():
            return ""
        digest = manifest.model_hash(manifest.manifest(path))
        with self._hash_lock:
            self._hashes[path] = digest
        return digest

    def known_hash(self, model_id: str, *, drafter: bool = False) -> str:
        """The hash last computed by `manifest_hash`, or ""; cheap, for status and registration."""
        path = self.drafter_path(model_id) if drafter else self._models[model_id].path
        with self._hash_lock:
            return self._hashes.get(path, "") if path is not None else ""

    def hash_all(self) -> None:
        """Compute every model's and drafter's manifest hash (before registering, so the coordinator can pin).
        Files that cannot be read leave that hash unknown ("" in the registration); they never stop the node
        from registering."""
        for mid in self.ids():
            for drafter in (False, True):
                try:
                    self.manifest_hash(mid, drafter=drafter)
                except OSError as e:
                    log.warning("manifest_hash_failed", model=mid, drafter=drafter, error=str(e))

    def facts(self, model_id: str) -> ModelFacts | None:
        """What the files say the model is; None while not downloaded or when its files cannot be read."""
        stored = self._models[model_id]
        if stored.path is None:
            return None
        try:
            return _facts(stored.path, (stored.path / "config.json").stat().st_mtime_ns, self.drafter_path(model_id))
        except Exception:  # a broken checkpoint is listed without facts; a job for it gets the load error
            return None


@functools.lru_cache(maxsize=256)
def _facts(path: Path, mtime_ns: int, drafter: Path | None = None) -> ModelFacts:
    from . import capability

    ckpt = open_checkpoint(path)
    caps = capability.with_drafter(capability.detect(path, ckpt.config), path, drafter, ckpt.config)
    return ModelFacts(size_bytes=estimate.weight_bytes(ckpt.config, ckpt.tensors), family=caps.family,
                      quantization=caps.quantization, context_length=caps.context_length,
                      native_mtp_heads=caps.native_mtp_heads, vision=caps.vision, mtp_capable=caps.mtp_capable,
                      draft_compatible=caps.draft_compatible, speculates_with=caps.speculates_with)
