"""KV of recently served prompts, per model, reused when a new prompt shares a prefix.

mlx-lm's `LRUPromptCache` does the keeping (a token trie, LRU order by kind, trimming a longer entry down
to the shared prefix when its caches can be trimmed). This adds what the node needs around it: a byte
bound the engine can shrink at any time (the memory budget counts these bytes and drops them before any
model is evicted), and a lookup that always leaves at least one prompt token to compute, since the first
generated token needs the logits of the last prompt token.

The index is counted too. The trie keeps a dict per stored token, and the LRU order a list of each entry's
tokens: about 260 bytes of Python heap a token (measured with tracemalloc in the tests). With a small model
that is as much as the KV itself, and prompts of distinct tokens are the cheapest thing a client can send,
so `nbytes` is the KV plus `INDEX_BYTES_PER_TOKEN` for every token the entries' keys hold (prefixes they
share counted again: a bound, not an estimate).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (KVCache, LRUPromptCache, QuantizedKVCache, can_trim_prompt_cache,
                                 trim_prompt_cache)

from .. import logs

log = logs.get("engine")

# Kinds, evicted in this order when the cache is over its bound: finished completions first, shared system
# prompts last (they are what the next request of every chat reuses).
COMPLETION, USER, SYSTEM = "assistant", "user", "system"

INDEX_BYTES_PER_TOKEN = 320


class _CountedOrder(LRUPromptCache.CacheOrder):
    """mlx-lm's LRU order, counting the tokens of the keys it holds (every entry passes through it)."""

    def __init__(self):
        super().__init__()
        self.tokens = 0

    def push(self, model, tokens, cache_type="assistant"):
        super().push(model, tokens, cache_type)
        self.tokens += len(tokens)

    def remove(self, model, tokens):
        before = len(self)
        super().remove(model, tokens)
        if len(self) < before:
            self.tokens -= len(tokens)

    def pop(self):
        model, tokens = super().pop()
        self.tokens -= len(tokens)
        return model, tokens


class PrefixCache:
    def __init__(self, model_id: str, max_bytes: int, unkeyable: frozenset[int] = frozenset()):
        self.model_id = model_id
        self.max_bytes = max_bytes
        # Token ids that never enter a key: every image token has one id, so a key holding them would match
        # another image's prompt. A prompt's text before its first image is still kept and reused.
        self.unkeyable = unkeyable
        self._lru = LRUPromptCache(max_size=1 << 20, max_bytes=max(0, max_bytes))
        self._order = self._lru._lru = _CountedOrder()

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.index_bytes

    @property
    def kv_bytes(self) -> int:
        return self._lru.nbytes

    @property
    def index_bytes(self) -> int:
        return self._order.tokens * INDEX_BYTES_PER_TOKEN

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """A copy of the caches of the longest stored prefix of `prompt`, and how many tokens it covers
        (fewer than len(prompt))."""
        if self.max_bytes <= 0 or not prompt:
            return None, 0
        cache, rest = self._lru.fetch_nearest_cache(self.model_id, list(prompt))
        if cache is None:
            return None, 0
        if not rest:  # the whole prompt is stored: give back one token to compute, or none at all
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        cached = len(prompt) - len(rest)
        return (cache, cached) if cached > 0 else (None, 0)

    def store(self, tokens: list[int], cache: list[Any], kind: str = COMPLETION) -> None:
        """Keep `cache` (the KV of `tokens`) for reuse. Never raises: keeping a prefix is an optimisation, and
        its failure costs no job."""
        if self.max_bytes <= 0 or not tokens or not cache or not self.unkeyable.isdisjoint(tokens):
            return
        try:
            owned(cache)
            self._lru.insert_cache(self.model_id, list(tokens), cache, cache_type=kind)
            self.trim_to(self.max_bytes)  # mlx-lm bounded the KV alone
        except Exception:
            log.exception("prefix_store_failed", model=self.model_id)

    def share(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep a copy of the caches of a row still using them (a prompt just read, for the choices to come)."""
        self.store(tokens, copy.deepcopy(cache), SYSTEM)

    def trim_to(self, max_bytes: int) -> int:
        """Drop least recently used entries until at most `max_bytes` remain; return the bytes freed."""
        before = self.nbytes
        while self.nbytes > max(0, max_bytes) and len(self._lru):
            self._lru.trim_to(n_sequences=len(self._lru) - 1)
        return before - self.nbytes

    def clear(self) -> int:
        return self.trim_to(0)


def owned(cache: list[Any]) -> None:
    """Make each layer's K/V arrays own exactly their bytes, evaluated now. What a batch hands back for a row is
    a lazy slice of the batch's buffers, and a slice (evaluated or not) keeps the whole buffer alive (rows x
    the longest row) while counting only itself; a KVCache also holds capacity past its offset. Copied and
    trimmed, an entry holds what `nbytes` says, and the batch's buffers go when the batch lets them go."""
    for c in cache:
        if isinstance(c, (KVCache, QuantizedKVCache)) and c.keys is not None:  # quantized: a triple of arrays each
            c.keys, c.values = (tuple(mx.contiguous(a[..., : c.offset, :]) for a in x) if isinstance(x, tuple)
                                else mx.contiguous(x[..., : c.offset, :]) for x in (c.keys, c.values))
        else:
            for name in ("keys", "values"):
                array = getattr(c, name, None)
                if isinstance(array, mx.array):
                    setattr(c, name, mx.contiguous(array))
    mx.eval([c.state for c in cache])
