"""The prefix cache's index (mlx-lm's token trie and LRU order) is Python heap a client grows with every distinct
prompt; the cache's byte bound counts it, so prompts of distinct tokens over tiny KV cannot grow it past the
bound (issue 20: everything a coordinator can make the node hold is bounded in bytes)."""

from __future__ import annotations

import random
import tracemalloc

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from provider.engine.prefix_cache import INDEX_BYTES_PER_TOKEN, PrefixCache
from tools.harness.isolated import run_isolated

VOCAB = 262_144  # Gemma's: token ids past the small-int cache, as a real model's are


def _tiny_kv(n_tokens: int) -> list[KVCache]:
    """One layer, one head of width 1: a few bytes of KV a token, so the index dominates."""
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, n_tokens, 1), mx.float16), mx.zeros((1, 1, n_tokens, 1), mx.float16))
    return [c]


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]


# The heap each test reads (tracemalloc's) is process-wide: each runs in a process of its own, where no other
# test's thread allocates while it stores (tools.harness.isolated).


def _index_heap() -> dict:
    cache = PrefixCache("m", max_bytes=1 << 40)
    prompts, kvs = _prompts(400, 200), [_tiny_kv(200) for _ in range(400)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for p, kv in zip(prompts, kvs):
            cache.store(p, kv)
        heap = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return {"heap": heap, "entries": len(cache), "index_bytes": cache.index_bytes}


def test_the_index_costs_no_more_a_token_than_is_counted():
    m = run_isolated(_index_heap)
    tokens = 400 * 200
    print(f"index heap {m['heap'] / tokens:.0f} bytes/token (counted {INDEX_BYTES_PER_TOKEN})")
    assert m["entries"] == 400
    assert m["index_bytes"] == tokens * INDEX_BYTES_PER_TOKEN
    assert m["heap"] / tokens <= INDEX_BYTES_PER_TOKEN


def _bounded_heap(bound: int) -> dict:
    cache = PrefixCache("m", max_bytes=bound)
    over = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for p in _prompts(1_000, 100, seed=1):  # 100,000 tokens: ~26 MB of index were it not counted
            cache.store(p, _tiny_kv(100))
            if cache.nbytes > bound:
                over.append(cache.nbytes)
        heap = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return {"heap": heap, "over": over, "entries": len(cache), "index_bytes": cache.index_bytes,
            "kv_bytes": cache.kv_bytes}


def test_distinct_prompts_over_tiny_kv_stay_within_the_bound():
    bound = 2 << 20
    m = run_isolated(_bounded_heap, bound)
    assert not m["over"], m["over"][:5]
    assert 0 < m["entries"] < 1_000  # the oldest went
    assert m["index_bytes"] > m["kv_bytes"]  # what the bound was spent on
    assert m["heap"] <= bound * 1.25, m["heap"]


def test_trimming_and_prefix_replacement_keep_the_count_true():
    cache = PrefixCache("m", max_bytes=1 << 30)
    p = _prompts(1, 300, seed=2)[0]
    cache.store(p[:100], _tiny_kv(100))
    cache.store(p, _tiny_kv(300))  # a trimmable entry replaces its stored prefixes
    assert len(cache) == 1 and cache.index_bytes == 300 * INDEX_BYTES_PER_TOKEN
    cache.store(p, _tiny_kv(300))  # the same key again: replaced, not counted twice
    assert cache.index_bytes == 300 * INDEX_BYTES_PER_TOKEN
    hit, covered, _ = cache.lookup(p[:200] + [1, 2, 3])
    assert hit is not None and covered == 200
    assert cache.trim_to(0) > 0 and len(cache) == 0 and cache.nbytes == 0


def test_keys_never_hold_image_tokens_but_the_text_before_an_image_is_kept():
    """Every image token has one id, so a key holding them would resume another image's prompt from this
    one's KV: such keys are not stored; the text before the image still is, and is found."""
    image = 8
    cache = PrefixCache("m", max_bytes=1 << 30, unkeyable=frozenset({image}))
    text = [1, 4, 99, 97, 274]
    with_image = text + [9] + [image] * 64 + [10, 50, 5]
    cache.store(with_image, _tiny_kv(len(with_image)))
    assert len(cache) == 0 and cache.lookup(with_image) == (None, 0, "")
    cache.store(text, _tiny_kv(len(text)))
    kv, cached, _ = cache.lookup(with_image)
    assert len(cache) == 1 and cached == len(text) and kv is not None


def test_a_jobs_claim_follows_its_entry_to_a_longer_one_and_ends_with_its_eviction():
    """What routing tells the coordinator a node holds (`holds`) is never more than the cache serves."""
    cache = PrefixCache("m", max_bytes=1 << 30)
    p, q = _prompts(2, 300, seed=3)
    cache.store(p[:100], _tiny_kv(100), claim="a")
    cache.store(p, _tiny_kv(300), claim="b")  # takes over a's entry as a prefix: a is still served
    cache.store(q, _tiny_kv(300), claim="c")
    cache.store(q, _tiny_kv(300))  # the same key again, unclaimed: c keeps it
    assert all(cache.holds(j) for j in "abc") and not cache.holds("d")
    hit, covered, _ = cache.lookup(p[:100] + [7])
    assert covered == 100  # what a claimed: served by b's entry
    cache.trim_to(cache.nbytes - 1)  # the least recently used entry goes (p's: q's was stored last)
    assert not cache.holds("a") and not cache.holds("b") and cache.holds("c")
    cache.clear()
    assert not cache.holds("c") and not cache.claims.live
