"""Timing mlx-lm's own forwards on fresh caches, as both the node and mlx_lm.server run them: shared by the
scheduling benchmarks (schedule_ceiling, bench_two_streams)."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def read_ms(model, rows: int, tokens: int, chunk: int | None = None) -> float:
    """Read `rows` prompts of `tokens` into fresh caches, `chunk` tokens a forward (default: all at once); ms."""
    chunk = chunk or tokens
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for i in range(0, tokens, chunk):
        model(mx.array([list(range(10 + i, 10 + i + min(chunk, tokens - i)))] * rows), cache=cache)
        mx.eval([c.state for c in cache])  # the KV only: a prompt read computes no logits
    return (time.perf_counter() - start) * 1e3


def decode_ms(model, rows: int, context: int, steps: int) -> float:
    """One decode step over `rows` rows after `context` tokens each, greedy, averaged over `steps`; ms."""
    cache = make_prompt_cache(model)
    model(mx.array([list(range(10, 10 + context))] * rows), cache=cache)
    mx.eval([c.state for c in cache])
    token = mx.array([[5]] * rows)
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
    return (time.perf_counter() - start) * 1e3 / steps
