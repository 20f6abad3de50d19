"""One prefix-cache entry as a file: its scope, its token ids and every layer's cache state, checked whole.

    MAGIC | u32 header length | header (JSON) | payload (the arrays' bytes) | sha256 of all that precedes

The cache kinds are a closed set (KINDS), named in the header and mapped to classes here: nothing is
constructed by a name the file chooses. A file is read only after its digest matches, and its header is
checked against the payload before any array is made, so a truncated, corrupted or foreign file is refused
(FileError) and never reaches MLX. Sealed jobs are never written (the caller's rule: prefix_disk.py).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from .kv_quant import QuantizedKVRow
from .kv_quant_rotating import QuantizedRotatingKVRow

MAGIC = b"PXKV1\n"
MAX_HEADER = 8 << 20
DIGEST = 32
# The kinds an entry may hold, by the name the header gives them, and how many arrays and ints their state has.
KINDS: dict[str, tuple[type, int, int]] = {
    "kv": (KVCache, 2, 1),  # keys, values; offset
    "rotating": (RotatingKVCache, 2, 4),  # keys, values; offset, keep, max_size, _idx
    "quantized": (QuantizedKVCache, 6, 3),  # keys and values as (packed, scales, biases); offset, group, bits
    "quantized_row": (QuantizedKVRow, 6, 3),
    "quantized_rotating": (QuantizedRotatingKVRow, 6, 6),  # as quantized; offset, keep, max_size, _idx, group, bits
}
_KIND_OF = {cls: name for name, (cls, _, _) in KINDS.items()}
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32, "uint32": mx.uint32}
_NP = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.float32, "uint32": np.uint32}


class FileError(ValueError):
    """Not an entry this node can use: truncated, corrupted, another format, or another scope."""


def storable(cache: list[Any]) -> bool:
    return bool(cache) and all(type(c) in _KIND_OF and getattr(c, "keys", None) is not None for c in cache)


def encode(scope: bytes, tokens: list[int], cache: list[Any]) -> bytes:
    """The file's bytes. The arrays must be evaluated (they are copied out here, on the caller's thread)."""
    layers, chunks, offset = [], [], 0
    for c in cache:
        kind = _KIND_OF[type(c)]
        state = c.state
        n_arrays = KINDS[kind][1]
        arrays = _flat(state[:2]) if n_arrays == 6 else list(state[:2])
        specs = []
        for a in arrays:
            name = str(a.dtype).split(".")[-1]
            if name not in DTYPES:
                raise FileError(f"a {name} cache array is not stored")
            raw = np.asarray(a.view(mx.uint16) if name in ("bfloat16", "float16") else a).tobytes()
            specs.append({"dtype": name, "shape": list(a.shape), "offset": offset, "nbytes": len(raw)})
            chunks.append(raw)
            offset += len(raw)
        layers.append({"kind": kind, "arrays": specs, "ints": [int(v) for v in state[2:]]})
    header = json.dumps({"scope": scope.hex(), "tokens": list(map(int, tokens)), "layers": layers},
                        separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + b"".join(chunks)
    return body + hashlib.sha256(body).digest()


def peek_header(path) -> dict:
    """The header of a file on disk, reading only it (the digest is checked when the entry is read)."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or not head.startswith(MAGIC):
            raise FileError("not a prefix-cache file")
        (length,) = struct.unpack_from("<I", head, len(MAGIC))
        if length > MAX_HEADER:
            raise FileError("header length out of range")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        raise FileError("header is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("tokens"), list) \
            or not all(isinstance(t, int) for t in header["tokens"]) or not isinstance(header.get("scope"), str):
        raise FileError("header fields missing")
    return header


def read_header(data: bytes) -> dict:
    """The checked header of a whole file (digest first)."""
    if len(data) < len(MAGIC) + 4 + DIGEST or not data.startswith(MAGIC):
        raise FileError("not a prefix-cache file")
    if hashlib.sha256(data[:-DIGEST]).digest() != data[-DIGEST:]:
        raise FileError("digest mismatch: truncated or corrupted")
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if length > MAX_HEADER or start + length > len(data) - DIGEST:
        raise FileError("header length out of range")
    try:
        header = json.loads(data[start:start + length])
    except ValueError:
        raise FileError("header is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("tokens"), list) \
            or not isinstance(header.get("layers"), list) or not isinstance(header.get("scope"), str):
        raise FileError("header fields missing")
    header["_payload"] = (start + length, len(data) - DIGEST)
    return header


def decode(data: bytes, scope: bytes) -> tuple[list[int], list[Any]]:
    """The entry's tokens and caches; FileError for anything but a whole, consistent file of `scope`."""
    header = read_header(data)
    if header["scope"] != scope.hex():
        raise FileError("another scope")
    tokens = header["tokens"]
    if not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens):
        raise FileError("token ids out of range")
    begin, end = header["_payload"]
    caches = []
    for layer in header["layers"]:
        kind = KINDS.get(layer.get("kind")) if isinstance(layer, dict) else None
        if kind is None:
            raise FileError("a layer of an unknown kind")
        cls, n_arrays, n_ints = kind
        specs, ints = layer.get("arrays"), layer.get("ints")
        if not isinstance(specs, list) or len(specs) != n_arrays or not isinstance(ints, list) \
                or len(ints) != n_ints or not all(isinstance(i, int) and 0 <= i < 2**40 for i in ints):
            raise FileError("a layer's state does not match its kind")
        arrays = [_array(s, data, begin, end) for s in specs]
        kv = (tuple(arrays[:3]), tuple(arrays[3:])) if n_arrays == 6 else tuple(arrays)
        caches.append(cls.from_state((*kv, *ints)))
    return tokens, caches


def _array(spec: Any, data: bytes, begin: int, end: int) -> mx.array:
    if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES or not isinstance(spec.get("shape"), list) \
            or not all(isinstance(d, int) and 0 <= d < 2**31 for d in spec["shape"]) or len(spec["shape"]) > 8:
        raise FileError("an array's spec is malformed")
    name, shape = spec["dtype"], spec["shape"]
    count = int(np.prod(shape, dtype=np.int64))
    nbytes, start = spec.get("nbytes"), spec.get("offset")
    if not isinstance(nbytes, int) or not isinstance(start, int) or nbytes != count * np.dtype(_NP[name]).itemsize \
            or start < 0 or begin + start + nbytes > end:
        raise FileError("an array's bytes do not match its shape")
    flat = np.frombuffer(data, dtype=_NP[name], count=count, offset=begin + start).reshape(shape)
    a = mx.array(flat)
    return a.view(DTYPES[name]) if a.dtype != DTYPES[name] else a  # 16-bit floats travel as their bits


def _flat(kv) -> list[mx.array]:
    return [a for triple in kv for a in triple]
