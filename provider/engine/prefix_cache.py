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

Entries are kept per scope (jobs.PrefixScope: the tenant that may reuse them): a prefix stored for one is
never found for another. Under the memory tier, the disk tier (prefix_disk.py): a long entry is also written
there (off this thread, within its budget and write rate; never a job that asked not to be, such as a sealed
one), and a prompt the memory tier covers less of than the disk does is read back from it, once the file is
found to hold caches of this model (kv_layout: taken from the model when it first reads from disk).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import (ArraysCache, KVCache, LRUPromptCache, QuantizedKVCache, RotatingKVCache,
                                 can_trim_prompt_cache, trim_prompt_cache)

from .. import logs
from ..jobs import PrefixScope
from . import kv_file, kv_layout
from .prefix_blocks import BLOCK, scope_of
from .prefix_disk import DiskTier

log = logs.get("engine")

# Kinds, evicted in this order when the cache is over its bound: finished completions first, shared system
# prompts last (they are what the next request of every chat reuses).
COMPLETION, USER, SYSTEM = "assistant", "user", "system"

INDEX_BYTES_PER_TOKEN = 320
DISK_MIN_TOKENS = 2 * BLOCK  # a prefill this long is worth a file; shorter ones are cheap to compute again
MEMORY, DISK = "memory", "disk"


class _CountedOrder(LRUPromptCache.CacheOrder):
    """mlx-lm's LRU order, counting the tokens of the keys it holds (every entry passes through it), and telling
    its cache's claims which entries left: `pop` is an eviction, `remove` a replacement or a prefix a longer
    entry now serves."""

    def __init__(self, claims: "Claims"):
        super().__init__()
        self.tokens = 0
        self.claims = claims

    def push(self, model, tokens, cache_type="assistant"):
        super().push(model, tokens, cache_type)
        self.tokens += len(tokens)

    def remove(self, model, tokens):
        before = len(self)
        super().remove(model, tokens)
        if len(self) < before:
            self.tokens -= len(tokens)
            self.claims.served_longer((model, tuple(tokens)))

    def pop(self):
        model, tokens = super().pop()
        self.tokens -= len(tokens)
        self.claims.evicted((model, tuple(tokens)))
        return model, tokens


class Claims:
    """Which finished jobs' prefixes the memory tier still serves (`live`, by job id), so that what a node tells
    its coordinator it holds (coordinator_client.routing.HeldPrefixes) is never more than it holds. A job's claim
    follows its entry: to the longer entry that takes it over as a prefix, out with an eviction. Written on the
    engine thread; `live` is only tested for membership elsewhere."""

    MAX = 4096  # claims followed; the oldest beyond are given up (held or not, no longer claimed)

    def __init__(self):
        self.live: set[str] = set()
        self._of: dict[tuple, list[str]] = {}  # entry (scope key, tokens) -> the jobs it serves
        self.inserting: tuple | None = None

    def add(self, entry: tuple, job_id: str) -> None:
        self._of.setdefault(entry, []).append(job_id)
        self.live.add(job_id)
        while len(self.live) > self.MAX and self._of:
            oldest = next(iter(self._of))
            self.evicted(oldest)

    def served_longer(self, entry: tuple) -> None:
        if self.inserting is not None and entry != self.inserting and entry in self._of:
            self._of.setdefault(self.inserting, []).extend(self._of.pop(entry))

    def evicted(self, entry: tuple) -> None:
        for job_id in self._of.pop(entry, ()):
            self.live.discard(job_id)


class PrefixCache:
    def __init__(self, model_id: str, max_bytes: int, unkeyable: frozenset[int] = frozenset(), *,
                 disk: DiskTier | None = None, identity: str = "", trimmable: bool = True,
                 layout: Callable[[], kv_layout.Layout | None] | None = None):
        self.model_id = model_id
        self.max_bytes = max_bytes
        # Token ids that never enter a key: every image token has one id, so a key holding them would match
        # another image's prompt. A prompt's text before its first image is still kept and reused.
        self.unkeyable = unkeyable
        self._lru = LRUPromptCache(max_size=1 << 20, max_bytes=max(0, max_bytes))
        self.claims = Claims()
        self._order = self._lru._lru = _CountedOrder(self.claims)
        self.disk = disk
        self.identity = identity  # the model's files (manifest.quick_identity): a disk entry outlives a process
        self.trimmable = trimmable  # caches a shorter prefix can be cut from (no sliding-window layers)
        # What a disk entry must hold to be used (kv_file.of_model), made when first needed; without it nothing
        # is read from disk.
        self._layout_of, self._layout = layout, None

    @classmethod
    def of(cls, lm, max_bytes: int, disk: DiskTier | None) -> "PrefixCache":
        """A loaded model's (models.loader.LoadedModel)."""
        from ..models.capability import media_token_ids
        from .kv_quant import caches_for

        # The KV's precision is part of what an entry is: one kept at 8 bits is no row of a full-precision batch.
        return cls(lm.id, max_bytes, media_token_ids(lm.config), disk=disk, identity=f"{lm.identity}/{lm.kv_quant}",
                   trimmable=cuttable(caches_for(lm)), layout=lambda: kv_file.of_model(lm))

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

    def lookup(self, prompt: list[int], scope: PrefixScope = PrefixScope()) -> tuple[list[Any] | None, int, str]:
        """A copy of the caches of the longest stored prefix of `prompt` in `scope`, how many tokens it covers
        (fewer than len(prompt)), and the tier it came from."""
        if not prompt or not scope.kept:
            return None, 0, ""
        cache, cached = self._from_memory(prompt, scope) if self.max_bytes > 0 else (None, 0)
        if self.disk is not None and scope.to_disk and len(prompt) > max(cached, BLOCK):
            try:
                found = self._from_disk(prompt, scope, cached)
            except Exception:  # a cache is an optimisation: its failure costs no job (the prompt is read instead)
                log.exception("prefix_disk_read_failed", model=self.model_id)
                found = None
            if found is not None:
                return (*found, DISK)
        return cache, cached, MEMORY if cached else ""

    def _from_memory(self, prompt: list[int], scope: PrefixScope) -> tuple[list[Any] | None, int]:
        cache, rest = self._lru.fetch_nearest_cache(self._key(scope), list(prompt))
        if cache is None:
            return None, 0
        if not rest:  # the whole prompt is stored: give back one token to compute, or none at all
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        cached = len(prompt) - len(rest)
        return (cache, cached) if cached > 0 else (None, 0)

    def _from_disk(self, prompt: list[int], scope: PrefixScope, better_than: int) -> tuple[list[Any], int] | None:
        key = self._scope(scope)
        best = self.disk.best(key, prompt, self.trimmable)
        if best is None or best[1] <= better_than:
            return None
        if self._layout_of is not None:  # once: a model whose layout cannot be taken reads nothing from disk
            layout_of, self._layout_of = self._layout_of, None
            self._layout = layout_of()
        if self._layout is None:
            return None
        read = self.disk.read(best[0], key, self._layout)
        if read is None:
            return None
        tokens, cache = read
        usable = min(best[1], len(prompt) - 1)
        if list(tokens[:usable]) != list(prompt[:usable]):
            return None  # the blocks matched, the tokens do not: a hash collision would be needed, never trust it
        if usable < len(tokens) and not can_trim_prompt_cache(cache):
            return None
        if usable < len(tokens):
            trim_prompt_cache(cache, len(tokens) - usable)
        self.disk.stats.tokens_reused += usable
        self.store(list(tokens[:usable]), copy.deepcopy(cache), SYSTEM, scope, to_disk=False)  # hot again
        return cache, usable

    def store(self, tokens: list[int], cache: list[Any], kind: str = COMPLETION, scope: PrefixScope = PrefixScope(),
              *, to_disk: bool = True, claim: str = "") -> None:
        """Keep `cache` (the KV of `tokens`) for reuse in `scope`; `claim`, the job it finished, is then held
        (`holds`) for as long as some entry serves its tokens. Never raises: keeping a prefix is an
        optimisation, and its failure costs no job."""
        if not tokens or not cache or not scope.kept or not self.unkeyable.isdisjoint(tokens):
            return
        try:
            if self.max_bytes > 0 or self.disk is not None:
                owned(cache)
            if self.disk is not None and to_disk and scope.to_disk and len(tokens) >= DISK_MIN_TOKENS:
                self.disk.put(self._scope(scope), list(tokens), cache, claim)
            if self.max_bytes > 0:
                entry = (self._key(scope), tuple(tokens))
                if claim:
                    self.claims.add(entry, claim)
                self.claims.inserting = entry
                try:
                    self._lru.insert_cache(self._key(scope), list(tokens), cache, cache_type=kind)
                finally:
                    self.claims.inserting = None
                self.trim_to(self.max_bytes)  # mlx-lm bounded the KV alone
        except Exception:
            log.exception("prefix_store_failed", model=self.model_id)

    def holds(self, claim: str) -> bool:
        """Any thread: whether the prefix job `claim` left is still served, from memory or disk."""
        return claim in self.claims.live or (self.disk is not None and self.disk.holds(claim))

    def prefetch(self, prompt: list[int], scope: PrefixScope) -> None:
        """Any thread (a prompt just prepared): read ahead the disk entry its lookup would use."""
        if self.disk is not None and scope.to_disk and scope.kept and len(prompt) > BLOCK:
            self.disk.prefetch(self._scope(scope), prompt, self.trimmable)

    def wants_whole_prompt(self, length: int, scope: PrefixScope) -> bool:
        """Whether a prompt is worth keeping whole once read: long, for the disk tier, of a model whose caches
        cannot be cut to a shorter prefix (so its finished row, prompt + completion, serves no later request of
        the same prompt)."""
        return self.disk is not None and scope.to_disk and scope.kept and not self.trimmable \
            and length >= DISK_MIN_TOKENS

    def share(self, tokens: list[int], cache: list[Any], scope: PrefixScope = PrefixScope()) -> None:
        """Keep a copy of the caches of a row still using them (a prompt just read, for the choices to come)."""
        self.store(tokens, copy.deepcopy(cache), SYSTEM, scope)

    def trim_to(self, max_bytes: int) -> int:
        """Drop least recently used entries until at most `max_bytes` remain; return the bytes freed."""
        before = self.nbytes
        while self.nbytes > max(0, max_bytes) and len(self._lru):
            self._lru.trim_to(n_sequences=len(self._lru) - 1)
        return before - self.nbytes

    def clear(self) -> int:
        return self.trim_to(0)

    def _key(self, scope: PrefixScope) -> tuple[str, str]:
        return self.model_id, scope.tenant

    def _scope(self, scope: PrefixScope) -> bytes:
        return scope_of(self.identity or self.model_id, scope.tenant)


def cuttable(cache: list[Any]) -> bool:
    """Whether a model's caches can always be cut to a shorter prefix: not with sliding-window layers (a
    rotating cache past its window has lost what a shorter prefix needs), whatever a fresh one says."""
    return not any(isinstance(c, RotatingKVCache) for c in cache)


def owned(cache: list[Any]) -> None:
    """Make each layer's K/V arrays own exactly their bytes, evaluated now. What a batch hands back for a row is
    a lazy slice of the batch's buffers, and a slice (evaluated or not) keeps the whole buffer alive (rows x
    the longest row) while counting only itself; a KVCache also holds capacity past its offset. Copied and
    trimmed, an entry holds what `nbytes` says, and the batch's buffers go when the batch lets them go. A hybrid's
    recurrent layer (ArraysCache: conv window, state) is a row of its batch's arrays the same way: copied too
    (mx.contiguous copies a view into a buffer of its own), its `nbytes` then its size, whatever the length."""
    for c in cache:
        if isinstance(c, ArraysCache):
            c.cache = [None if a is None else mx.contiguous(a) for a in c.cache]
        elif isinstance(c, (KVCache, QuantizedKVCache)) and c.keys is not None:  # quantized: a triple of arrays each
            c.keys, c.values = (tuple(mx.contiguous(a[..., : c.offset, :]) for a in x) if isinstance(x, tuple)
                                else mx.contiguous(x[..., : c.offset, :]) for x in (c.keys, c.values))
        else:
            for name in ("keys", "values"):
                array = getattr(c, name, None)
                if isinstance(array, mx.array):
                    setattr(c, name, mx.contiguous(array))
                elif isinstance(array, tuple):  # a quantized sliding layer's triple
                    setattr(c, name, tuple(mx.contiguous(a) for a in array))
    mx.eval([c.state for c in cache])
