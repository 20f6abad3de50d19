"""Samplers from SamplingParams, built on mlx-lm's sampling functions.

Every sampled job draws from a PRNG key of its own (its seed, or fresh entropy),
never from MLX's global random state: its output does not depend on what other
jobs the engine interleaves with it, and no job's failure can break another's.
"""

from __future__ import annotations

import secrets
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from ..jobs import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def sampler_for(params: SamplingParams, limit: int | None = None) -> Sampler:
    """The job's sampler; with `limit`, it draws only ids below it (those the detokenizer can decode)."""
    if params.greedy:
        argmax = make_sampler(temp=0.0)
        return argmax if limit is None else (lambda logprobs: argmax(logprobs[..., :limit]))
    return _keyed_sampler(params, job_seed(params), limit)


def logits_processors_for(params: SamplingParams) -> list | None:
    if not params.has_logits_processors:
        return None
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)


def filters_for(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """top_p, min_p and top_k over log-probabilities (any leading shape), in mlx-lm's make_sampler order."""
    filters = []
    if 0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))

    def apply(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        return logprobs

    return apply


def job_seed(params: SamplingParams) -> int:
    return secrets.randbits(63) if params.seed is None else params.seed


def _keyed_sampler(params: SamplingParams, seed: int, limit: int | None) -> Sampler:
    key = mx.random.key(seed)
    filtered = filters_for(params)
    inv_temp = 1 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        # In float32: 1/T times half-precision logits overflows at small temperatures.
        logprobs = logprobs[..., :limit].astype(mx.float32)
        return mx.random.categorical(filtered(logprobs) * inv_temp, key=sub)

    return sample
