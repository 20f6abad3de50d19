"""What a model's prompt caches look like, and a stored entry's header checked against it before it is used.

A layout is taken from the model itself: a fresh set of its caches (at its KV precision) after one token, so
each layer's kind, each array's dtype and every dimension but the sequence's are the model's, whatever its
family. A disk entry (kv_file) is used only if its header agrees with the layout layer by layer: as many
layers, of the same kinds, the same fixed ints (a window's size and kept tokens, a quantization's group and
bits), arrays of the same dtypes and shapes, every layer's offset the entry's token count, a sequence length
that offset allows, and the arrays' bytes laid end to end over the whole payload. A file that says anything
else (a layer short, a shape whose element count would wrap, an offset past its keys) is refused before any
array is made (issue 56: one such file used to be read as a hit and silently change the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SEQ_AXIS = 2  # [batch, kv heads, positions, head dim] (a quantized array's last dim is packed)
# Per kind: how many arrays and ints its state has, which ints are fixed by the model (not the offset, nor a
# window's write position), and whether the kind is a sliding window.
KINDS: dict[str, tuple[int, int, tuple[int, ...], bool]] = {
    "kv": (2, 1, (), False),  # offset
    "rotating": (2, 4, (1, 2), True),  # offset, keep, max_size, _idx
    "quantized": (6, 3, (1, 2), False),  # offset, group, bits
    "quantized_row": (6, 3, (1, 2), False),
    "quantized_rotating": (6, 6, (1, 2, 4, 5), True),  # offset, keep, max_size, _idx, group, bits
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "uint32": 4}


class LayoutError(ValueError):
    """An entry's header that does not describe a cache of this model."""


@dataclass(frozen=True)
class LayerLayout:
    kind: str
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # dtype, shape with the sequence axis as -1
    fixed: tuple[int, ...]  # the kind's fixed ints, in KINDS' order


Layout = tuple[LayerLayout, ...]


def layer(kind: str, arrays: list, ints: list[int]) -> LayerLayout:
    """A layer's layout from its kind, arrays and ints (kv_file.layer_state)."""
    shapes = tuple((str(a.dtype).split(".")[-1], tuple(-1 if i == SEQ_AXIS else d for i, d in enumerate(a.shape)))
                   for a in arrays)
    return LayerLayout(kind, shapes, tuple(int(ints[i]) for i in KINDS[kind][2]))


def check(layers: Any, layout: Layout, n_tokens: int, payload: int) -> None:
    """Raise LayoutError unless `layers` (a header's) describe caches of `layout` holding `n_tokens` tokens whose
    arrays fill the `payload` bytes exactly, end to end."""
    if not isinstance(layers, list) or len(layers) != len(layout):
        raise LayoutError(f"{len(layers) if isinstance(layers, list) else 'no'} layers, the model has "
                          f"{len(layout)}")
    at = 0
    for i, (layer, want) in enumerate(zip(layers, layout)):
        if not isinstance(layer, dict) or layer.get("kind") != want.kind:
            raise LayoutError(f"layer {i} is not of the model's kind")
        n_arrays, n_ints, fixed, sliding = KINDS[want.kind]
        specs, ints = layer.get("arrays"), layer.get("ints")
        if not isinstance(specs, list) or len(specs) != n_arrays or not isinstance(ints, list) \
                or len(ints) != n_ints or not all(type(v) is int for v in ints):
            raise LayoutError(f"layer {i}'s state does not match its kind")
        if tuple(ints[j] for j in fixed) != want.fixed:
            raise LayoutError(f"layer {i}'s window or quantization is not the model's")
        seq = set()
        for spec, (dtype, shape) in zip(specs, want.arrays):
            seq.add(_check_array(spec, dtype, shape, at, i))
            at += spec["nbytes"]
        if len(seq) != 1:
            raise LayoutError(f"layer {i}'s arrays hold different numbers of positions")
        _check_offset(ints, seq.pop(), n_tokens, sliding, i)
    if at != payload:
        raise LayoutError("the arrays do not fill the payload")


def _check_array(spec: Any, dtype: str, shape: tuple[int, ...], offset: int, layer: int) -> int:
    """The array's length along the sequence axis, once its dtype, shape, place and size are the model's."""
    if not isinstance(spec, dict) or spec.get("dtype") != dtype or not isinstance(spec.get("shape"), list) \
            or len(spec["shape"]) != len(shape) or not all(type(d) is int for d in spec["shape"]):
        raise LayoutError(f"layer {layer} has an array of another dtype or rank")
    got = spec["shape"]
    if any(w != -1 and g != w for g, w in zip(got, shape)) or not 0 <= got[SEQ_AXIS] < 2**31:
        raise LayoutError(f"layer {layer} has an array of another shape")
    nbytes = ITEMSIZE[dtype] * int(np.prod(np.array(got, dtype=object)))  # Python ints: no wrap
    if spec.get("nbytes") != nbytes or spec.get("offset") != offset:
        raise LayoutError(f"layer {layer} has an array whose bytes are not where its shape puts them")
    return got[SEQ_AXIS]


def _check_offset(ints: list[int], seq: int, n_tokens: int, sliding: bool, layer: int) -> None:
    offset = ints[0]
    if offset != n_tokens:
        raise LayoutError(f"layer {layer}'s offset is not the entry's token count")
    if not sliding:
        if seq != offset:
            raise LayoutError(f"layer {layer} holds another number of positions than its offset")
        return
    max_size, idx = ints[2], ints[3]
    if not min(offset, max_size) <= seq <= max(offset, max_size) or not 0 <= idx <= seq:
        raise LayoutError(f"layer {layer}'s window positions are not ones its offset allows")
