"""Quantized KV caches, one sequence's and a batch's, and the one function that makes a model's caches.

mlx-lm's `QuantizedKVCache` keeps one sequence's keys and values as `mx.quantize` gives them: a (packed, scales,
biases) triple per tensor, `bits` per element in groups of `group_size` along the head dimension, and attention
reads them with quantized matmuls (`models.base.scaled_dot_product_attention` takes that path when the cache has
`bits`). Its batch caches have no quantized form; `BatchQuantizedKVCache` is `BatchKVCache` over such triples:
the same left padding, growth in 256-position steps, prepare/finalize, masks, filter, extend, extract and merge.
Every one of those moves positions along the sequence axis, which each array of a triple has in the same place,
so each applies to the three arrays alike; a quantization group never spans positions.

`QuantizedKVRow` is one sequence's (mlx-lm's QuantizedKVCache with `merge` and `size`), so the generator's
`_merge_caches`, the speculative rounds' `merged`, `extract` and the prefix cache handle quantized rows as any.

What is quantized (`caches_for`): the full-attention layers' caches, in the group memory.estimate.full_layer_quant
gives, and the sliding-window layers' (kv_quant_rotating.QuantizedRotatingKVRow, mlx-lm's RotatingKVCache over
triples), in the group memory.estimate.sliding_layer_quant gives; the ledger books both by the same rules. A layer
whose head dimension no supported group divides keeps full precision. A draft model keeps its own KV in full
precision (it is small; the ledger books it so).

Gemma 4's KV-shared layers (and the MTP assistant, built of the same layers) attend to the triples an earlier
layer's cache returned with no cache of their own: `install` gives mlx-lm's gemma4_text an attention that sees a
triple and reads its bits and group from the shapes.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    dynamic_roll,
    make_prompt_cache,
)

from ..memory.estimate import full_layer_quant, sliding_layer_quant
from .kv_quant_rotating import QuantizedRotatingKVRow, join_rows
from .kv_quant_rotating import each as _each
from .kv_quant_rotating import empty_triple as _zeros


class QuantizedKVRow(QuantizedKVCache):
    """One sequence's quantized KV (mlx-lm's layout), mergeable into a BatchQuantizedKVCache."""

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in (*self.keys, *self.values))


class BatchQuantizedKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache with keys and values stored as QuantizedKVCache stores them."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys, values):
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            B, H, _, dk = keys.shape
            grow = (self.step + n - 1) // self.step * self.step  # BatchKVCache's growth, which the ledger books
            new_k = _zeros((B, H, grow), dk, self.group_size, self.bits, keys.dtype)
            new_v = _zeros((B, H, grow), values.shape[3], self.group_size, self.bits, values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step != 0:
                    self.keys, self.values = (_each(x, lambda a: a[..., :prev, :]) for x in (self.keys, self.values))
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, new_k))
                self.values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.values, new_v))
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for held, new in ((self.keys, qk), (self.values, qv)):
            for a, b in zip(held, new):
                a[..., prev:self._idx, :] = b
        return self.keys_and_values()

    def keys_and_values(self):
        return tuple(_each(x, lambda a: a[..., :self._idx, :]) for x in (self.keys, self.values))

    def finalize(self):
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self.keys, self.values = (_each(x, lambda a: dynamic_roll(a, shift, axis=2))
                                      for x in (self.keys, self.values))
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys, self.values = (_each(x, lambda a: a[batch_indices]) for x in (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())  # drop the padding every row has
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = (_each(x, lambda a: a[..., shift:, :]) for x in (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        join_rows(self, other)

    def extract(self, idx):
        row = QuantizedKVRow(self.group_size, self.bits)
        padding = self.left_padding.tolist()[idx]
        row.keys, row.values = (_each(x, lambda a: mx.contiguous(a[idx:idx + 1, :, padding:self._idx]))
                                for x in (self.keys, self.values))
        row.offset = self._idx - padding
        return row

    @classmethod
    def merge(cls, caches):
        """One batch of per-sequence caches (QuantizedKVRow; a full-precision KVCache is quantized on the way)."""
        first = next((c for c in caches if isinstance(c, QuantizedKVCache)), None)
        group, bits = (first.group_size, first.bits) if first is not None else (64, 8)
        rows = [_quantized(c, group, bits) for c in caches]
        lengths = [c.offset if c.keys is not None else 0 for c in rows]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(rows), group, bits)
        padding = [longest - n for n in lengths]
        like = next(c for c in rows if c.keys is not None)

        def blank(x):
            return tuple(mx.zeros((len(rows), a.shape[1], longest, a.shape[3]), dtype=a.dtype) for a in x)

        keys, values = blank(like.keys), blank(like.values)
        for i, (p, c) in enumerate(zip(padding, rows)):
            if c.keys is None:
                continue
            for held, own in ((keys, c.keys), (values, c.values)):
                for a, b in zip(held, own):
                    a[i:i + 1, :, p:p + c.offset] = b[..., :c.offset, :]
        batch = cls(padding, group, bits)
        batch.keys, batch.values = keys, values
        batch.offset += longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in (*self.keys, *self.values))


def _quantized(c, group: int, bits: int) -> QuantizedKVCache:
    if isinstance(c, QuantizedKVCache):
        return c
    if isinstance(c, KVCache):  # a full-precision row joining a quantized batch
        return c.to_quantized(group_size=group, bits=bits)
    raise TypeError(f"{type(c).__name__} cannot join a quantized KV batch")


def caches_for(lm) -> list:
    """A fresh set of caches for one sequence of `lm` (a models.loader.LoadedModel): mlx-lm's, with each
    full-attention KVCache a QuantizedKVRow and each sliding-window RotatingKVCache a QuantizedRotatingKVRow when
    `lm.kv_quant` asks for one (as memory.estimate books them)."""
    return make_caches(lm.model, lm.config, lm.kv_quant)


def make_caches(model, config: dict, quant) -> list:
    caches = make_prompt_cache(model)
    full, sliding = full_layer_quant(config, quant), sliding_layer_quant(config, quant)
    if full is None and sliding is None:
        return caches
    install()

    def stored(c):
        if type(c) is KVCache and full is not None:
            return QuantizedKVRow(full.group_size, full.bits)
        if type(c) is RotatingKVCache and sliding is not None:
            return QuantizedRotatingKVRow(c.max_size, c.keep, sliding.group_size, sliding.bits)
        return c

    return [stored(c) for c in caches]


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention, also for a quantized (packed, scales, biases) K/V reached without its cache (Gemma 4's
    KV-shared layers, the MTP assistant): its bits and group follow from the shapes and the head dimension."""
    if isinstance(keys, tuple) and not hasattr(cache, "bits"):
        dim = queries.shape[-1]
        return base.quantized_scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, group_size=dim // keys[1].shape[-1],
            bits=keys[0].shape[-1] * 32 // dim)
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install() -> None:
    """Give mlx-lm's Gemma 4 text layers `attention` (idempotent; the same as before for full-precision K/V)."""
    from mlx_lm.models import gemma4_text

    gemma4_text.scaled_dot_product_attention = attention
