"""Each output token against the distribution the verifier computes for its position: what the node says it
drew with (jobs.Proof.sampler) decides the check.

- greedy: the token is the argmax, or within `tie` nats of it (a near-tie the two forwards may break apart);
- replayable: the token is the argmax of the seeded Gumbel draw at its position (engine.sampling.perturbed),
  or within `tie` of it: an exact replay, so a wrong temperature, filter, seed or model shows at once;
- speculative (sampled by a speculative round without a seed, which nobody can replay): the token is inside
  the job's filtered support (top-p / min-p / top-k), and its probability under the declared temperature is
  not below `floor`. A plausibility check only: docs/verification.md says what it cannot catch.

The logits are the model's raw ones; penalties and logit bias are applied as the node applied them (mlx-lm's
processors, over the context so far), then a constrained job's grammar mask (`GrammarReplay`: the producer's
masks, recomputed by walking the job's own grammar along the claimed tokens), then log-softmax, as mlx-lm's
generator does before its sampler. Every check above then judges the masked distribution.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..engine.grammar import RowGrammar, masked
from ..engine.sampling import logits_processors_for, perturbed, sampling_scores
from ..jobs import GREEDY_SAMPLER, REPLAYABLE_SAMPLER, SamplingParams
from ..types import Cause


def processed(logits: mx.array, params: SamplingParams, context: list[int], first: int,
              masks: np.ndarray | None = None) -> mx.array:
    """logits [m, V] of output positions first.. -> log-probabilities after the job's processors (penalties see
    the context before each position: the prompt and the output so far) and its grammar's `masks` [m, V]."""
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
    if masks is not None:  # last, as the producer's GrammarProcessor: what the grammar forbids stays forbidden
        logits = masked(logits, mx.array(masks))
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


class GrammarReplay:
    """A constrained job's masks as its producer computed them: the job's own grammar (compiled from the job, as
    for generating it; a RowGrammar, so `auto`'s free text and its calls are followed as the row followed them)
    walked along the claimed output, each token taken after the mask it was drawn under. Chunk by chunk, in
    order: the walk carries over from one chunk to the next."""

    def __init__(self, grammar: RowGrammar):
        self.grammar = grammar
        self.failure: tuple[int, str] | None = None  # (output position, why): where the claim left its grammar

    def masks(self, tokens: list[int], first: int) -> np.ndarray:
        """[m, width] booleans: the mask at output positions first.. (those past a failure allow everything:
        the verdict fails at the failure)."""
        g = self.grammar
        out = np.ones((len(tokens), g.width), dtype=bool)
        for i, t in enumerate(tokens):
            j = first + i
            # The mask first: computing it can itself stop the matcher (a bound), at this position, as it did the row's.
            allowed = g.allowed() if self.failure is None and g.error is None else None
            if self.failure is None and g.error is not None:
                self._stopped(j)
            if self.failure is not None:
                break
            out[i] = allowed
            if not (t < allowed.size and allowed[t]):
                self.failure = (j, f"output token {j} is one the job's grammar forbids there")
            else:
                g.consume([t])  # an error taking it shows at the next position, as the producer's row saw it
        return out

    def _stopped(self, j: int) -> None:
        """The matcher failed before position j's token was drawn. Past one of its bounds (the request's fault,
        deterministic), the producer's row failed there too, with no outcome to claim: the claim fails at j.
        Anything else is this node's own failure, never the claim's: raised, and the verify job fails with it."""
        if self.grammar.error.cause != Cause.INVALID_REQUEST:
            raise self.grammar.error
        self.failure = (j, f"the job's grammar stopped before output token {j}: {self.grammar.error.message}")
