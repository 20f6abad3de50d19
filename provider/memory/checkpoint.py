"""A checkpoint's files, read once: config.json and the safetensors headers, as a frozen description.

The one reader of both. Capability detection, footprint estimates, the catalog, the store and the drafter
kinds (provider.drafters) all read through it; nothing here loads weights. A description is cached per file
state, so a changed file is read again and an unchanged one never is. It sits with the arithmetic over what it
reads (memory.estimate), below both models and drafters, so that either may read a checkpoint.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ..jobs import JobError
from ..types import Cause

MAX_HEADER_BYTES = 100 << 20
Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)


class HeaderError(ValueError):
    """A safetensors file is truncated or its header is not valid."""


def read_config(path: Path) -> dict:
    """config.json as a dict, or JobError(MODEL_LOAD_FAILED) saying what is wrong with it."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as e:  # ValueError covers bad JSON and bad UTF-8
        raise JobError(Cause.MODEL_LOAD_FAILED, f"cannot read {path / 'config.json'}: {e}") from None
    if not isinstance(config, dict):
        raise JobError(Cause.MODEL_LOAD_FAILED, f"{path / 'config.json'} is not a JSON object "
                                                f"(it holds a {type(config).__name__})")
    return config


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: 8-byte little-endian length, then JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HeaderError(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise HeaderError(f"{path.name}: header length {n} is not plausible")
        data = f.read(n)
    if len(data) != n:
        raise HeaderError(f"{path.name}: header is truncated")
    try:
        header = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeaderError(f"{path.name}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path.name}: header is not a JSON object")
    header.pop("__metadata__", None)
    size = path.stat().st_size
    try:
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
    except (TypeError, KeyError, IndexError):
        raise HeaderError(f"{path.name}: header entries have no data_offsets") from None
    if 8 + n + end > size:
        raise HeaderError(f"{path.name}: tensors end at byte {8 + n + end} but the file has {size}")
    return header


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict

    @functools.cached_property
    def tensors(self) -> Tensors:
        """Every tensor of every safetensors file: read on first use (HeaderError if one is broken)."""
        out: Tensors = {}
        for f in sorted(self.path.glob("*.safetensors")):
            for name, t in read_safetensors_header(f).items():
                out[name] = (t["dtype"], tuple(t["shape"]))
        return out


def open_checkpoint(path: Path) -> Checkpoint:
    """The description of the checkpoint in `path`, read once per state of its files."""
    files = [path / "config.json", *sorted(path.glob("*.safetensors"))]
    state = tuple((f.name, st.st_mtime_ns, st.st_size) for f in files if (st := _stat(f)) is not None)
    return _open(path, state)


def _stat(f: Path):
    try:
        return f.stat()
    except OSError:
        return None


@functools.lru_cache(maxsize=256)
def _open(path: Path, state: tuple) -> Checkpoint:
    return Checkpoint(path, read_config(path))


FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def dominant_float_bytes(tensors: Tensors) -> int:
    """The float width most of a checkpoint's float tensors have: what its weights, and so its activations and KV,
    are computed in (2 when it has none)."""
    sizes: dict[int, int] = {}
    for dtype, _shape in tensors.values():
        if dtype in FLOAT_BYTES:
            sizes[FLOAT_BYTES[dtype]] = sizes.get(FLOAT_BYTES[dtype], 0) + 1
    return max(sizes, key=sizes.get) if sizes else 2


DEFAULT_CONTEXT = 4096  # when the config names no context length


def context_length(config: dict) -> int:
    text = config.get("text_config")
    for cfg in (config, text if isinstance(text, dict) else {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx"):
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return DEFAULT_CONTEXT
