"""Samplers from SamplingParams, built on mlx-lm's sampling functions.

Every sampled job draws from keys of its own (its seed, or fresh entropy), never from MLX's global random
state: its output does not depend on what other jobs the engine interleaves with it, and no job's failure can
break another's. The token at output position j is the Gumbel-max draw

    argmax(filtered(logprobs) / T + gumbel(position_key(seed, j)))

which is an exact sample from the job's distribution, and depends on nothing but the logits, the parameters,
the seed and j: not on how many draws came before, whether the job speculated first, or which node drew it.
So a verifier holding the seed replays every token (provider.verification.replay), and a speculative round
that drafts with the same noise (acceptance.CoupledChoice) gives exactly the tokens plain decoding gives.
"""

from __future__ import annotations

import secrets
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from ..jobs import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def sampler_for(params: SamplingParams, limit: int | None = None, *, seed: int | None = None,
                start: int = 0) -> Sampler:
    """The job's sampler; with `limit`, it draws only ids below it (those the detokenizer can decode). A sampled
    job draws with `seed` (the job's own, by default) its tokens from output position `start` on."""
    if params.greedy:
        argmax = make_sampler(temp=0.0)
        return argmax if limit is None else (lambda logprobs: argmax(logprobs[..., :limit]))
    return _positional_sampler(params, job_seed(params) if seed is None else seed, limit, start)


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


_MASK64 = (1 << 64) - 1


def position_key(seed: int, position: int) -> mx.array:
    """The PRNG key of output position `position` of a job seeded `seed`: splitmix64 of the pair, so keys of
    neighbouring positions and seeds are unrelated."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mx.random.key((z ^ (z >> 31)) >> 1)


def sampling_scores(logprobs: mx.array, params: SamplingParams, limit: int | None = None) -> mx.array:
    """What a sampled token is drawn over: the filtered log-probabilities over the temperature, in float32
    (1/T times half-precision logits overflows at small temperatures), over the ids below `limit`."""
    return filters_for(params)(logprobs[..., :limit].astype(mx.float32)) * (1 / params.temperature)


def perturbed(scores: mx.array, seed: int, position: int) -> mx.array:
    """`scores` [..., V] plus position `position`'s Gumbel noise: the draw is its argmax."""
    return scores + mx.random.gumbel(scores.shape[-1:], key=position_key(seed, position))


def _positional_sampler(params: SamplingParams, seed: int, limit: int | None, start: int) -> Sampler:
    position = start

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal position
        token = mx.argmax(perturbed(sampling_scores(logprobs, params, limit), seed, position), axis=-1)
        position += 1
        return token

    return sample
