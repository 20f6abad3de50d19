"""One prefix-cache entry as a file: its scope, its token ids and every layer's cache state, authenticated.

    MAGIC | u32 header length | header (JSON) | header MAC | payload (the arrays' bytes) | MAC

Both MACs are HMAC-SHA256 under the disk tier's key (prefix_disk_dir.load_key: 0600 in the state directory),
each under its own label: the header's lets a restart index a file by reading its header alone, the last
covers every byte before it. A digest anyone can compute would not do (issue 56): the scope is a hash of the
model files' names, sizes and times, so a file planted or rewritten by whoever can write the directory was
read as a hit. A file is used only after its MAC matches and its header agrees with the model (kv_layout:
layers, kinds, dtypes, shapes, offsets, every array's place in the payload), before any array is made; the
cache kinds are a closed set (KINDS), so nothing is constructed by a name the file chooses. Anything else is
a FileError, and the tier deletes the file. Sealed jobs are never written (the caller's rule: prefix_disk.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from . import kv_layout
from .kv_quant import QuantizedKVRow, caches_for
from .kv_quant_rotating import QuantizedRotatingKVRow

MAGIC = b"PXKV2\n"  # PXKV1 (an unkeyed SHA-256) is refused like any other foreign file
MAX_HEADER = 8 << 20
MAC = 32
HEAD = len(MAGIC) + 4
_HEADER_LABEL, _FILE_LABEL = b"provider.prefix-disk.header\0", b"provider.prefix-disk.file\0"
# The kinds an entry may hold, by the name the header gives them (their state: kv_layout.KINDS).
KINDS: dict[str, type] = {"kv": KVCache, "rotating": RotatingKVCache, "quantized": QuantizedKVCache,
                          "quantized_row": QuantizedKVRow, "quantized_rotating": QuantizedRotatingKVRow}
_KIND_OF = {cls: name for name, cls in KINDS.items()}
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32, "uint32": mx.uint32}
_NP = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.float32, "uint32": np.uint32}


class FileError(ValueError):
    """Not an entry this node can use: truncated, corrupted, unauthenticated, another format, scope or model."""


@dataclass
class Planned:
    """An entry's file before its bytes are copied: what the write rate is charged for (`size`)."""

    head: bytes  # MAGIC, the header's length, the header
    arrays: list  # the arrays whose bytes make the payload, in order
    size: int  # the whole file's


def storable(cache: list[Any]) -> bool:
    return bool(cache) and all(type(c) in _KIND_OF and getattr(c, "keys", None) is not None for c in cache)


def layer_state(c: Any) -> tuple[str, list[mx.array], list[int]]:
    """A layer's kind, arrays (a quantized triple flattened) and ints; a growing cache's arrays cut to its offset."""
    kind = _KIND_OF[type(c)]
    state = c.state
    n_arrays, _, _, sliding = kv_layout.KINDS[kind]
    arrays = [a for triple in state[:2] for a in triple] if n_arrays == 6 else list(state[:2])
    if not sliding:
        arrays = [a[..., :c.offset, :] if a.shape[kv_layout.SEQ_AXIS] > c.offset else a for a in arrays]
    return kind, arrays, [int(v) for v in state[2:]]


def of_model(lm) -> kv_layout.Layout | None:
    """The layout of `lm`'s caches (models.loader.LoadedModel), from one token through a fresh set: None for a
    model whose caches the disk tier does not keep (a hybrid's recurrent layers). On the engine thread."""
    caches = caches_for(lm)
    mx.eval(lm.model(mx.array([[0]]), cache=caches))
    return of_caches(caches) if storable(caches) else None


def of_caches(caches: list) -> kv_layout.Layout:
    """The layout of a model's caches holding at least one token."""
    return tuple(kv_layout.layer(*layer_state(c)) for c in caches)


def plan(scope: bytes, tokens: list[int], cache: list[Any]) -> Planned:
    """The entry's header and size, from shapes alone: nothing is copied."""
    layers, arrays, offset = [], [], 0
    for c in cache:
        kind, state, ints = layer_state(c)
        specs = []
        for a in state:
            name = str(a.dtype).split(".")[-1]
            if name not in DTYPES:
                raise FileError(f"a {name} cache array is not stored")
            specs.append({"dtype": name, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
            offset += a.nbytes
        arrays += state
        layers.append({"kind": kind, "arrays": specs, "ints": ints})
    header = json.dumps({"scope": scope.hex(), "tokens": list(map(int, tokens)), "layers": layers},
                        separators=(",", ":")).encode()
    head = MAGIC + struct.pack("<I", len(header)) + header
    return Planned(head, arrays, len(head) + MAC + offset + MAC)


def copy_out(planned: Planned) -> list[bytes]:
    """The payload's bytes, copied out of MLX (the arrays evaluated; on the thread that owns them)."""
    return [np.asarray(a.view(mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a).tobytes()
            for a in planned.arrays]


def seal(head: bytes, chunks: list[bytes], key: bytes) -> list[bytes]:
    """The file's bytes, in pieces to write: the header's MAC after it, the whole's at the end."""
    head_mac = hmac.new(key, _HEADER_LABEL + head, hashlib.sha256).digest()
    whole = hmac.new(key, _FILE_LABEL + head + head_mac, hashlib.sha256)
    for chunk in chunks:
        whole.update(chunk)
    return [head, head_mac, *chunks, whole.digest()]


def encode(scope: bytes, tokens: list[int], cache: list[Any], key: bytes) -> bytes:
    planned = plan(scope, tokens, cache)
    return b"".join(seal(planned.head, copy_out(planned), key))


def read_head(f, key: bytes) -> dict:
    """The authenticated header of an open file, reading only it (a restart's index)."""
    head = f.read(HEAD)
    if len(head) < HEAD or not head.startswith(MAGIC):
        raise FileError("not a prefix-cache file of this version")
    (length,) = struct.unpack_from("<I", head, len(MAGIC))
    if length > MAX_HEADER:
        raise FileError("header length out of range")
    raw = f.read(length)
    if len(raw) != length or not _authentic(key, _HEADER_LABEL + head + raw, f.read(MAC)):
        raise FileError("header MAC mismatch: not written with this node's key")
    return _fields(raw)


def whole_size(f, header: dict) -> int:
    """The size of the whole file whose authenticated `header` read_head just read from `f`: its head, then
    the arrays the header lists, then the file's MAC. A file grown or cut since it was written is not it."""
    try:
        payload = sum(int(spec["nbytes"]) for layer in header["layers"] for spec in layer["arrays"])
    except (KeyError, TypeError, ValueError):
        raise FileError("the header does not list its arrays") from None
    return f.tell() + payload + MAC


def decode(data: bytes, scope: bytes, key: bytes, layout: kv_layout.Layout | None) -> tuple[list[int], list[Any]]:
    """The entry's tokens and caches; FileError for anything but a whole, authentic file of `scope` whose every
    layer is one of `layout` (the model's: of_model)."""
    if len(data) < HEAD + 2 * MAC or not data.startswith(MAGIC):
        raise FileError("not a prefix-cache file of this version")
    if not _authentic(key, _FILE_LABEL + data[:-MAC], data[-MAC:]):
        raise FileError("MAC mismatch: truncated, corrupted or not written with this node's key")
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    begin, end = HEAD + length + MAC, len(data) - MAC
    if length > MAX_HEADER or begin > end:
        raise FileError("header length out of range")
    header = _fields(data[HEAD:HEAD + length])
    if header["scope"] != scope.hex():
        raise FileError("another scope")
    if layout is None:
        raise FileError("the model's caches are not kept on disk")
    try:
        kv_layout.check(header["layers"], layout, len(header["tokens"]), end - begin)
    except kv_layout.LayoutError as e:
        raise FileError(f"not a cache of this model: {e}") from None
    caches = []
    for layer in header["layers"]:
        arrays = [_array(s, data, begin) for s in layer["arrays"]]
        kv = (tuple(arrays[:3]), tuple(arrays[3:])) if len(arrays) == 6 else tuple(arrays)
        caches.append(KINDS[layer["kind"]].from_state((*kv, *layer["ints"])))
    return header["tokens"], caches


def _authentic(key: bytes, message: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(hmac.new(key, message, hashlib.sha256).digest(), mac)


def _fields(raw: bytes) -> dict:
    try:
        header = json.loads(raw)
    except ValueError:
        raise FileError("header is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("scope"), str) or len(header["scope"]) != 64 \
            or not isinstance(header.get("tokens"), list) or not isinstance(header.get("layers"), list):
        raise FileError("header fields missing")
    if not header["tokens"] or not all(type(t) is int and 0 <= t < 2**32 for t in header["tokens"]):
        raise FileError("token ids out of range")
    return header


def _array(spec: dict, data: bytes, begin: int) -> mx.array:
    """An array whose spec kv_layout.check found to be the model's and within the payload."""
    name, shape = spec["dtype"], spec["shape"]
    flat = np.frombuffer(data, dtype=_NP[name], count=spec["nbytes"] // np.dtype(_NP[name]).itemsize,
                         offset=begin + spec["offset"]).reshape(shape)
    a = mx.array(flat)
    return a.view(DTYPES[name]) if a.dtype != DTYPES[name] else a  # 16-bit floats travel as their bits
