"""SHA-256 manifest of a checkpoint: per-file hashes, computed once and cached by (size, mtime)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import paths
from ..jobs import JobError
from ..types import Cause

CHUNK = 8 << 20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _cache_file(model_dir: Path) -> Path:
    key = hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest()[:20]
    return paths.cache_dir() / "manifests" / f"{key}.json"


def files_of(model_dir: Path) -> list[Path]:
    # HF cache snapshots are symlinks into blobs/: follow them, hash the content.
    return sorted(p for p in model_dir.rglob("*") if p.is_file() and not p.name.startswith("."))


def manifest(model_dir: Path, *, recompute: bool = False) -> dict[str, str]:
    """relative path -> sha256 for every file; unchanged files are not re-read unless `recompute`."""
    cache_path = _cache_file(model_dir)
    try:
        cached = {} if recompute else json.loads(cache_path.read_text())
    except (OSError, json.JSONDecodeError):
        cached = {}
    out, entries = {}, {}
    for f in files_of(model_dir):
        rel = str(f.relative_to(model_dir))
        st = f.stat()
        hit = cached.get(rel)
        if hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns:
            digest = hit["sha256"]
        else:
            digest = _sha256(f)
        out[rel] = digest
        entries[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    if entries != cached:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(entries, indent=1, sort_keys=True))
    return out


def model_hash(files: dict[str, str]) -> str:
    """One SHA-256 for the whole checkpoint: over `sha256sum`-style lines, sorted by path."""
    lines = "".join(f"{digest}  {rel}\n" for rel, digest in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def verify_pin(model_id: str, path: Path, pinned: str) -> None:
    actual = model_hash(manifest(path)) if path.is_dir() else "(missing)"
    if actual != pinned:
        raise JobError(Cause.WEIGHTS_MISMATCH,
                       f"{model_id}: checkpoint hash {actual[:16]}… does not match the pinned {pinned[:16]}…; "
                       "the files changed since they were pinned — re-download, or update the pin after "
                       "checking them with `provider models verify`")


def quick_identity(path: Path) -> str:
    """The checkpoint's files as they are now (names, sizes, modification times), hashed without reading them:
    what a prefix kept on disk belongs to. A file rewritten since gives another identity, so its KV is never
    read back against other weights."""
    h = hashlib.sha256(b"provider.files\0")
    for f in sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
