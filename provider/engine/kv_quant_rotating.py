"""Quantized sliding-window KV caches, one sequence's and a batch's, and the triple helpers every quantized cache
here shares.

A quantized K or V is what `mx.quantize` gives: a (packed, scales, biases) triple, `bits` per element in groups of
`group_size` along the head dimension, every array with the sequence axis where a full-precision K has it (axis 2).
A group never spans positions, so any positional operation of a cache (slicing, rolling, padding, trimming to the
window, concatenating rows) applied to each array of a triple alike gives the triple of the moved values.

`QuantizedRotatingKVRow` is mlx-lm's RotatingKVCache (one sequence, a window of `max_size` positions, the first
`keep` never evicted) over such triples, and `BatchQuantizedRotatingKVCache` is its BatchRotatingKVCache: the same
rotation and trim to the window, left padding, prepare/finalize of right-padded prompts, masks, filter, extend,
extract, merge, trim and size, each array of a triple moved alike. Both are subclasses of mlx-lm's, so what tells
a sliding cache by its class (the prefix cache's cut rule, speculation's rollback, the MTP assistant's read of the
last sliding layer) still does, and both carry `bits` and `group_size`, so mlx-lm's attention reads them with
quantized matmuls. mlx-lm itself quantizes no rotating cache (`to_quantized` raises).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache, dynamic_roll


def each(x, f):
    """`f` over each array of a triple (or over a plain array)."""
    return tuple(f(a) for a in x) if isinstance(x, tuple) else f(x)


def empty_triple(shape: tuple, dim: int, group_size: int, bits: int, dtype) -> tuple:
    """An empty triple of `shape` (B, H, L) positions of `dim` elements."""
    return (mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32), mx.zeros((*shape, dim // group_size), dtype=dtype),
            mx.zeros((*shape, dim // group_size), dtype=dtype))


def _cat(x: tuple, y: tuple) -> tuple:
    return tuple(mx.concatenate([a, b], axis=2) for a, b in zip(x, y))


def _put(held: tuple, new: tuple, start: int, end: int) -> None:
    for a, b in zip(held, new):
        a[..., start:end, :] = b


def _length(x) -> int:
    return x[0].shape[2]


def join_rows(batch, other) -> None:
    """`other`'s rows after `batch`'s, both right-justified at the later write position and padded to the longer
    (BatchKVCache.extend and BatchRotatingKVCache.extend over triples; the quantized full and sliding forms)."""
    idx = max(batch._idx, other._idx)
    size = max(_length(c.keys) for c in (batch, other) if c.keys is not None)
    like = batch if batch.keys is not None else other

    def pad(c):  # right-justified at `idx`, `size` positions long
        k, v = c.keys, c.values
        if k is None:
            rows = c.offset.shape[0]
            k, v = (tuple(mx.zeros((rows, a.shape[1], 0, a.shape[3]), dtype=a.dtype) for a in x)
                    for x in (like.keys, like.values))
        left = idx - c._idx
        right = size - _length(k) - left
        if right < 0:
            k, v = (each(x, lambda a: a[..., :right, :]) for x in (k, v))
            right = 0
        if left or right:
            k, v = (each(x, lambda a: mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)])) for x in (k, v))
        return k, v, c.offset, c.left_padding + left

    (k1, v1, o1, l1), (k2, v2, o2, l2) = pad(batch), pad(other)
    batch.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
    batch.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
    batch.offset, batch.left_padding = mx.concatenate([o1, o2]), mx.concatenate([l1, l2])
    batch._idx = idx


def _grow(cache, keys, values, prev: int) -> None:
    """Room for `step` more positions (at most up to the window) after `prev`, as mlx-lm's rotating caches grow
    before the window is full; the row form and the batch form alike."""
    B, H, _, dk = keys.shape
    size = min(cache.step, cache.max_size - prev)
    new_k = empty_triple((B, H, size), dk, cache.group_size, cache.bits, keys.dtype)
    new_v = empty_triple((B, H, size), values.shape[3], cache.group_size, cache.bits, values.dtype)
    if cache.keys is None:
        cache.keys, cache.values = new_k, new_v
    else:
        cache.keys, cache.values = _cat(cache.keys, new_k), _cat(cache.values, new_v)
    cache._idx = prev


class QuantizedRotatingKVRow(RotatingKVCache):
    """One sequence's sliding-window KV, stored as QuantizedKVCache stores it; mergeable into a
    BatchQuantizedRotatingKVCache."""

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8):
        super().__init__(max_size, keep)
        self.group_size, self.bits = group_size, bits

    def _quantize(self, x) -> tuple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _trim(self, trim_size, v, append=None):
        if append is None:
            return each(v, lambda a: RotatingKVCache._trim(self, trim_size, a))
        return tuple(RotatingKVCache._trim(self, trim_size, a, b) for a, b in zip(v, append))

    def _temporal_order(self, v):
        return each(v, lambda a: RotatingKVCache._temporal_order(self, a))

    def _update_concat(self, keys, values):
        keys, values = self._quantize(keys), self._quantize(values)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:  # in temporal order, then cut to max_size - 1 so every new position sees a whole window
            self.keys, self.values = self._temporal_order(self.keys), self._temporal_order(self.values)
            self._idx = _length(self.keys)
            trim_size = self._idx - self.max_size + 1
            self.keys, self.values = self._trim(trim_size, self.keys, keys), self._trim(trim_size, self.values, values)
        self.offset += _length(keys)
        self._idx = _length(self.keys)
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        S = keys.shape[2]
        prev = self.offset
        if self.keys is None or (prev >= _length(self.keys) and _length(self.keys) < self.max_size):
            _grow(self, keys, values, prev)
        trim_size = _length(self.keys) - self.max_size
        if trim_size > 0:
            self.keys, self.values = self._trim(trim_size, self.keys), self._trim(trim_size, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:  # rotate
            self._idx = self.keep
        _put(self.keys, self._quantize(keys), self._idx, self._idx + S)
        _put(self.values, self._quantize(values), self._idx, self._idx + S)
        self.offset += S
        self._idx += S
        return self.keys_and_values()

    def keys_and_values(self):
        if self.offset < _length(self.keys):
            return tuple(each(x, lambda a: a[..., :self.offset, :]) for x in (self.keys, self.values))
        return self.keys, self.values

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx, self.group_size, self.bits = v

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedRotatingKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in (*self.keys, *self.values))


def quantized_rotating(c: RotatingKVCache, group_size: int, bits: int) -> QuantizedRotatingKVRow:
    """`c` as a quantized row (a full-precision sliding row joining a quantized batch): the same positions."""
    if isinstance(c, QuantizedRotatingKVRow):
        return c
    row = QuantizedRotatingKVRow(c.max_size, c.keep, group_size, bits)
    row.offset, row._idx = c.offset, c._idx
    if c.keys is not None:
        row.keys, row.values = row._quantize(c.keys), row._quantize(c.values)
    return row


class BatchQuantizedRotatingKVCache(BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache with keys and values stored as QuantizedKVCache stores them."""

    def __init__(self, max_size: int, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(max_size, left_padding)
        self.group_size, self.bits = group_size, bits

    def _quantize(self, x) -> tuple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _both(self, f) -> None:
        self.keys, self.values = each(self.keys, f), each(self.values, f)

    def _roll_rows(self, shift) -> None:
        self._both(lambda a: dynamic_roll(a, shift[:, None], axis=2))

    def _evaluated_with_padding(self) -> None:  # mlx-lm's: left_padding and offset are evaluated with the keys
        self.keys = (mx.depends(self.keys[0], (self.left_padding, self.offset)), *self.keys[1:])

    def _trim(self, trim_size, v, append=None):
        if trim_size > 0:
            v = each(v, lambda a: a[..., trim_size:, :])
        return v if append is None else _cat(v, append)

    def _temporal_order(self):
        if self.rotated:
            shift = -self._idx
            self._both(lambda a: mx.roll(a, shift, axis=2))
            self._idx = _length(self.keys)
            self.rotated = False

    def _update_concat(self, keys, values):
        keys, values = self._quantize(keys), self._quantize(values)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self._temporal_order()
            if _length(self.keys) > self._idx:
                end = self._idx
                self._both(lambda a: a[..., :end, :])
            if self._lengths is not None:  # right-padded rows: roll so padding never evicts real positions
                roll = mx.maximum(0, self.offset - self._lengths)
                self._roll_rows(roll)
                self.left_padding += roll
                self.offset = self.offset - roll
            trim_size = self._idx - self.max_size + 1
            if trim_size > 0:
                self.left_padding -= trim_size
            self.keys, self.values = self._trim(trim_size, self.keys, keys), self._trim(trim_size, self.values, values)
        S = _length(keys)
        self.offset = self.offset + S
        self._offset += S
        self._idx = _length(self.keys)
        self._evaluated_with_padding()
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        if self._lengths is not None:
            raise RuntimeError("finalize() should be called before decoding with BatchRotatingKVCache")
        S = keys.shape[2]
        prev = self._offset
        if self.keys is None or (prev >= _length(self.keys) and _length(self.keys) < self.max_size):
            _grow(self, keys, values, prev)
        trim_size = _length(self.keys) - self.max_size
        if trim_size > 0:
            self.keys, self.values = self._trim(trim_size, self.keys), self._trim(trim_size, self.values)
            self._idx = self.max_size
            self.left_padding -= trim_size
        if self._idx == self.max_size:  # rotate
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding -= S
        _put(self.keys, self._quantize(keys), self._idx, self._idx + S)
        _put(self.values, self._quantize(values), self._idx, self._idx + S)
        self._offset += S
        self.offset = self.offset + S
        self._idx += S
        self._evaluated_with_padding()
        return self.keys_and_values()

    def keys_and_values(self):
        if self._offset < _length(self.keys):
            return tuple(each(x, lambda a: a[..., :self._offset, :]) for x in (self.keys, self.values))
        return self.keys, self.values

    def finalize(self):
        if self._lengths is not None:
            roll = mx.maximum(0, self.offset - self._lengths)
            self._roll_rows(roll)
            self.left_padding += roll
            self.offset = self.offset - roll
            self._lengths = None

    def filter(self, batch_indices):
        if self.keys is not None:
            self._both(lambda a: a[batch_indices])
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]

    def extend(self, other):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        if self.rotated != other.rotated or self._idx != other._idx:
            self._temporal_order()
            other._temporal_order()
        join_rows(self, other)
        self._offset = max(self._offset, other._offset)

    def extract(self, idx):
        mx.eval(self.left_padding, self.offset)
        row = QuantizedRotatingKVRow(self.max_size, 0, self.group_size, self.bits)
        padding = max(0, self.left_padding.tolist()[idx])
        k, v = (each(x, lambda a: a[idx:idx + 1]) for x in (self.keys, self.values))
        end = self._idx
        if self.rotated:
            shift = -self._idx
            k, v = (each(x, lambda a: mx.roll(a, shift, axis=2)) for x in (k, v))
            end = self.max_size
        row.keys, row.values = (each(x, lambda a: mx.contiguous(a[:, :, padding:end])) for x in (k, v))
        row.offset = self.offset.tolist()[idx]
        row._idx = _length(row.keys)
        return row

    @classmethod
    def merge(cls, caches):
        """One batch of per-sequence sliding caches (QuantizedRotatingKVRow; a full-precision RotatingKVCache is
        quantized on the way), each row's last `size()` positions in temporal order, left-padded to the longest."""
        if not all(c.max_size == caches[0].max_size for c in caches):
            raise ValueError("BatchRotatingKVCache can only merge caches with the same maximum size")
        first = next((c for c in caches if isinstance(c, QuantizedRotatingKVRow)), None)
        group, bits = (first.group_size, first.bits) if first is not None else (64, 8)
        rows = [quantized_rotating(c, group, bits) for c in caches]
        lengths = [c.size() for c in rows]
        longest = max(lengths)
        if longest == 0:
            return cls(caches[0].max_size, [0] * len(rows), group, bits)
        padding = [longest - n for n in lengths]
        like = next(c for c in rows if c.keys is not None)

        def blank(x):
            return tuple(mx.zeros((len(rows), a.shape[1], longest, a.shape[3]), dtype=a.dtype) for a in x)

        keys, values = blank(like.keys), blank(like.values)
        for i, (p, n, c) in enumerate(zip(padding, lengths, rows)):
            if c.keys is None or n == 0:
                continue
            for held, own in ((keys, c._temporal_order(c.keys)), (values, c._temporal_order(c.values))):
                for a, b in zip(held, own):
                    a[i:i + 1, :, p:p + n] = b[..., -n:, :]
        batch = cls(caches[0].max_size, padding, group, bits)
        batch.keys, batch.values = keys, values
        batch.offset = mx.array([c.offset for c in rows])
        batch._idx = batch._offset = longest
        return batch

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in (*self.keys, *self.values))
