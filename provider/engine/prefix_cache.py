"""KV of recently served prompts, per model, reused when a new prompt shares a prefix.

mlx-lm's `LRUPromptCache` does the keeping (a token trie, LRU order by kind, trimming a longer entry down
to the shared prefix when its caches can be trimmed). This adds what the node needs around it: a byte
bound the engine can shrink at any time (the memory budget counts these bytes and drops them before any
model is evicted), and a lookup that always leaves at least one prompt token to compute, since the first
generated token needs the logits of the last prompt token.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

# Kinds, evicted in this order when the cache is over its bound: finished completions first, shared system
# prompts last (they are what the next request of every chat reuses).
COMPLETION, USER, SYSTEM = "assistant", "user", "system"


class PrefixCache:
    def __init__(self, model_id: str, max_bytes: int):
        self.model_id = model_id
        self.max_bytes = max_bytes
        self._lru = LRUPromptCache(max_size=1 << 20, max_bytes=max(0, max_bytes))

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

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
        if self.max_bytes <= 0 or not tokens or not cache:
            return
        owned(cache)
        self._lru.insert_cache(self.model_id, list(tokens), cache, cache_type=kind)

    def trim_to(self, max_bytes: int) -> int:
        """Drop least recently used entries until at most `max_bytes` remain; return the bytes freed."""
        before = self.nbytes
        self._lru.trim_to(n_bytes=max(0, max_bytes))
        return before - self.nbytes

    def clear(self) -> int:
        return self.trim_to(0)


def owned(cache: list[Any]) -> None:
    """Make each layer's K/V arrays own exactly their bytes, evaluated now. What a batch hands back for a row is
    a lazy slice of the batch's buffers, and a slice (evaluated or not) keeps the whole buffer alive (rows x
    the longest row) while counting only itself; a KVCache also holds capacity past its offset. Copied and
    trimmed, an entry holds what `nbytes` says, and the batch's buffers go when the batch lets them go."""
    for c in cache:
        if isinstance(c, KVCache) and c.keys is not None:
            c.keys = mx.contiguous(c.keys[..., : c.offset, :])
            c.values = mx.contiguous(c.values[..., : c.offset, :])
        else:
            for name in ("keys", "values"):
                array = getattr(c, name, None)
                if isinstance(array, mx.array):
                    setattr(c, name, mx.contiguous(array))
    mx.eval([c.state for c in cache])
