"""Where models live: configured sources, the node's models directory, and the Hugging Face cache."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import logs
from ..jobs import JobError
from ..settings import ModelSpec, Settings
from ..drafters.assistant import ASSISTANT_TYPES, GEMMA4_TYPES

log = logs.get("store")


@dataclass(frozen=True)
class StoredModel:
    id: str
    source: str  # directory or repo id, as given to the loader
    path: Path | None  # None while a configured repo id is not downloaded yet
    origin: str  # configured | models_dir | hf_cache
    sha256: str | None = None  # pinned checkpoint hash, if any
    drafter: str | None = None  # configured drafter source, if any
    drafter_sha256: str | None = None  # pinned hash of the drafter's files, if any
    pin: bool = False  # loaded at start, never unloaded (settings.ModelSpec)
    idle_timeout_s: float | None = None  # None: the node's idle_timeout_s
    kv_bits: int | None = None  # None: the node's kv_bits
    kv_group_size: int | None = None

    def kv_precision(self, node_bits: int, node_group_size: int) -> tuple[int, int]:
        """The KV bits and group size it is served with: its own [models.<id>] keys, else the node's."""
        return (node_bits if self.kv_bits is None else self.kv_bits,
                node_group_size if self.kv_group_size is None else self.kv_group_size)


def _config(path: Path) -> dict | None:
    from ..memory.checkpoint import open_checkpoint

    try:
        return open_checkpoint(path).config  # read once per state of the files
    except JobError:
        return None


def _is_servable(path: Path) -> bool:
    """A model directory that is not a drafter. One whose config cannot be read is listed too, so that
    `models list` and `doctor` show why it is unavailable; a job for it gets the typed load error."""
    if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
        return False
    cfg = _config(path)
    return cfg is None or cfg.get("model_type") not in ASSISTANT_TYPES


def models_dir(settings: Settings) -> Path:
    from .. import paths

    return Path(settings.models_dir).expanduser() if settings.models_dir else paths.cache_dir() / "models"


def hf_cache_models() -> list[tuple[str, Path]]:
    """(repo id, snapshot path) for complete model snapshots in the Hugging Face cache."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:  # no cache yet, or an unreadable one: nothing to offer
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        out.append((repo.repo_id, Path(newest.snapshot_path)))
    return out


def discover(settings: Settings, extra: list[ModelSpec] = ()) -> list[StoredModel]:
    """Every servable model this node knows of; the first of a given id wins (configured first)."""
    from .loader import model_id_for

    found: dict[str, StoredModel] = {}

    def add(m: StoredModel) -> None:
        if m.id not in found:
            found[m.id] = m

    for spec in [*extra, *settings.models]:
        p = Path(spec.source).expanduser()
        add(StoredModel(spec.id or model_id_for(spec.source), spec.source, p if p.is_dir() else None, "configured",
                        spec.sha256 or None, spec.drafter or None, spec.drafter_sha256 or None, spec.pin,
                        spec.idle_timeout_s, spec.kv_bits, spec.kv_group_size))
    root = models_dir(settings)
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.is_dir() and _is_servable(p):
                add(StoredModel(p.name, str(p), p, "models_dir"))
    snapshots = hf_cache_models()  # the cache is scanned once per discovery
    for repo_id, snap in snapshots:
        if _is_servable(snap):
            add(StoredModel(repo_id, repo_id, snap, "hf_cache"))
    assistants = functools.cache(lambda: assistant_dirs(settings, snapshots))  # only if a Gemma 4 needs one
    return [_with_found_drafter(m, assistants) for m in found.values()]


def _with_found_drafter(m: StoredModel, assistants: Callable[[], list[Path]]) -> StoredModel:
    """A Gemma 4 target with no configured drafter gets a paired assistant from the store, if one fits."""
    from dataclasses import replace

    if m.drafter or m.path is None or (_config(m.path) or {}).get("model_type") not in GEMMA4_TYPES:
        return m
    found = find_drafter_for(m.path, assistants())
    return replace(m, drafter=str(found)) if found else m


def find_drafter_for(target: Path, candidates: list[Path]) -> Path | None:
    """An assistant checkpoint whose backbone size and vocabulary fit `target`, e.g. `<name>-assistant`."""
    from .capability import pair_assistant

    named = [c for c in candidates if c.name == f"{target.name}-assistant"]
    for c in named + [c for c in candidates if c not in named]:
        cfg = _config(c)
        if cfg and cfg.get("model_type") in ASSISTANT_TYPES and pair_assistant(target, c, None, cfg).paired:
            return c
    return None


def assistant_dirs(settings: Settings, snapshots: list[tuple[str, Path]] | None = None) -> list[Path]:
    root = models_dir(settings)
    dirs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    dirs += [snap for _, snap in (hf_cache_models() if snapshots is None else snapshots)]
    return [d for d in dirs if (_config(d) or {}).get("model_type") in ASSISTANT_TYPES]
