"""Each output token against the distribution the verifier computes for its position: what the node says it
drew with (jobs.Proof.sampler) decides the check.

- greedy: the token is the argmax, or within `tie` nats of it (a near-tie the two forwards may break apart);
- replayable: the token is the argmax of the seeded Gumbel draw at its position (engine.sampling.perturbed),
  or within `tie` of it: an exact replay, so a wrong temperature, filter, seed or model shows at once;
- plausible (drawn under a grammar's masks, which the verifier does not replay yet): the token's raw
  log-probability is not below `floor`;
- speculative (sampled by a speculative round without a seed, which nobody can replay): the token is inside
  the job's filtered support (top-p / min-p / top-k), and its probability under the declared temperature is
  not below `floor`. A plausibility check only: docs/verification.md says what it cannot catch.

The logits are the model's raw ones; penalties and logit bias are applied as the node applied them (mlx-lm's
processors, over the context so far), then log-softmax, as mlx-lm's generator does before its sampler.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..engine.sampling import logits_processors_for, perturbed, sampling_scores
from ..jobs import GREEDY_SAMPLER, REPLAYABLE_SAMPLER, SamplingParams

PLAUSIBLE = "plausible"  # tokens drawn under a grammar's masks: only their log-probability is judged


def processed(logits: mx.array, params: SamplingParams, context: list[int], first: int) -> mx.array:
    """logits [m, V] of output positions first.. -> log-probabilities after the job's processors (penalties see
    the context before each position: the prompt and the output so far)."""
    processors = logits_processors_for(params)
    if processors:
        rows = []
        for i in range(logits.shape[0]):
            row = logits[i:i + 1]
            ctx = mx.array(context[:first + i])
            for p in processors:
                row = p(ctx, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def token_gaps(logprobs: mx.array, tokens: list[int], positions: list[int], params: SamplingParams, sampler: str,
               seed: int | None, limit: int | None) -> mx.array:
    """Per position, how far the token falls short of the one the check expects (0 when it is that one; +inf
    when it cannot be drawn at all), lazily: [m] float32.

    greedy / replayable: best score - the token's score; speculative: -(the token's log-probability under the
    temperature) when it is inside the filtered support, else +inf."""
    if limit is not None:  # an id past what the node may draw (it samples below `limit`) cannot be drawn at all
        outside = mx.array([t >= limit for t in tokens])
        tokens = [min(t, limit - 1) for t in tokens]
    at = mx.array(tokens)[:, None]
    gaps = _gaps(logprobs, at, positions, params, sampler, seed, limit)
    return mx.where(outside, math.inf, gaps) if limit is not None else gaps


def _gaps(logprobs: mx.array, at: mx.array, positions: list[int], params: SamplingParams, sampler: str,
          seed: int | None, limit: int | None) -> mx.array:
    if sampler == PLAUSIBLE:
        own = mx.take_along_axis(logprobs, at, axis=-1)[:, 0]
        return mx.where(mx.isfinite(own), -own, math.inf)
    if sampler == GREEDY_SAMPLER:
        scores = logprobs[..., :limit]
    elif sampler == REPLAYABLE_SAMPLER:
        base = sampling_scores(logprobs, params, limit)
        scores = mx.concatenate([perturbed(base[i:i + 1], seed, p) for i, p in enumerate(positions)], axis=0)
    else:
        scores = sampling_scores(logprobs, params, limit)
        probs = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
        own = mx.take_along_axis(probs, at, axis=-1)[:, 0]
        return mx.where(mx.isfinite(own), -own, math.inf)
    own = mx.take_along_axis(scores, at, axis=-1)[:, 0]
    gap = scores.max(axis=-1) - own
    return mx.where(mx.isfinite(own), gap, math.inf)
