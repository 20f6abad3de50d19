"""Each output token against the distribution the verifier computes for its position: what the node says it
drew with (outputs.Proof.sampler) decides the check.

- greedy: the token is the argmax, or within `tie` nats of it (a near-tie the two forwards may break apart);
- replayable: the token is the argmax of the seeded Gumbel draw at its position (engine.sampling.perturbed),
  or within `tie` of it: an exact replay, so a wrong temperature, filter, seed or model shows at once;
- speculative (sampled by a speculative round without a seed, which nobody can replay): the token is inside
  the job's filtered support (top-p / min-p / top-k), and its probability under the declared temperature is
  not below `floor`. A plausibility check only: docs/verification.md says what it cannot catch.

The filtered support's edge is judged with the same tolerance (`support_scores`): a token within `tie` of a
top-k / top-p / min-p boundary may have been in the producer's support or out of it (its log-softmax rounds
otherwise: mlx-lm's takes it in the model's dtype, and float16 ties at the k-th place break either way). So a
drawn token passes when it is inside the support loosened by `tie` and its score is at least the best of
the support tightened by `tie`. Seen: a seeded top_k 40 job on the float16 demo pair, whose 40th to 42nd
tokens tie in float16 and part by 0.005 nats in float32; the verifier's support kept the one whose noise
won, the producer's another (verify_campaign, 1 honest job in 2,600, fails without this).

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
from ..engine.sampling import logits_processors_for, perturbed
from ..jobs import SamplingParams
from ..outputs import GREEDY_SAMPLER, REPLAYABLE_SAMPLER
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
               seed: int | None, limit: int | None, edge: float = 0.0) -> mx.array:
    """Per position, how far the token falls short of the one the check expects (0 when it is that one or
    better; +inf when it cannot be drawn at all), lazily: [m] float32. `edge`: how far (nats) a filter's
    boundary may lie otherwise on the producer (support_scores).

    greedy / replayable: best score - the token's score; speculative: -(the token's log-probability under the
    temperature) when it is inside the filtered support, else +inf."""
    if limit is not None:  # an id past what the node may draw (it samples below `limit`) cannot be drawn at all
        outside = mx.array([t >= limit for t in tokens])
        tokens = [min(t, limit - 1) for t in tokens]
    at = mx.array(tokens)[:, None]
    gaps = _gaps(logprobs, at, positions, params, sampler, seed, limit, edge)
    return mx.where(outside, math.inf, gaps) if limit is not None else gaps


def _gaps(logprobs: mx.array, at: mx.array, positions: list[int], params: SamplingParams, sampler: str,
          seed: int | None, limit: int | None, edge: float) -> mx.array:
    if sampler == GREEDY_SAMPLER:
        best = theirs = logprobs[..., :limit]
    elif sampler == REPLAYABLE_SAMPLER:
        surely, maybe = support_scores(logprobs, params, limit, edge)
        best = mx.concatenate([perturbed(surely[i:i + 1], seed, p) for i, p in enumerate(positions)], axis=0)
        theirs = mx.concatenate([perturbed(maybe[i:i + 1], seed, p) for i, p in enumerate(positions)], axis=0)
    else:
        _, maybe = support_scores(logprobs, params, limit, edge)
        probs = maybe - mx.logsumexp(maybe, axis=-1, keepdims=True)
        own = mx.take_along_axis(probs, at, axis=-1)[:, 0]
        return mx.where(mx.isfinite(own), -own, math.inf)
    own = mx.take_along_axis(theirs, at, axis=-1)[:, 0]
    gap = mx.maximum(best.max(axis=-1) - own, 0.0)
    return mx.where(mx.isfinite(own), gap, math.inf)


def support_scores(logprobs: mx.array, params: SamplingParams, limit: int | None,
                   edge: float) -> tuple[mx.array, mx.array]:
    """The request's sampling scores (engine.sampling.sampling_scores: filtered log-probabilities over the
    temperature) twice: over the tokens surely inside its filters, more than `edge` nats inside each boundary
    (top_p's also at top_p - edge), and over those maybe inside, within `edge` of one (top_p + edge). Filters
    keep a prefix of the tokens by probability, so each is a threshold on log-probability, and mlx-lm's
    top_p, min_p, top_k in turn keep the tokens above the highest."""
    lp = logprobs[..., :limit].astype(mx.float32)
    surely = maybe = mx.full(lp.shape[:-1] + (1,), -math.inf)
    if 0 < params.top_p < 1.0:
        surely = _top_p_threshold(lp, max(params.top_p - edge, 1e-6))
        maybe = _top_p_threshold(lp, min(params.top_p + edge, 1.0))
    if params.min_p != 0.0:
        t = lp.max(axis=-1, keepdims=True) + math.log(params.min_p)
        surely, maybe = mx.maximum(surely, t), mx.maximum(maybe, t)
    if 0 < params.top_k < lp.shape[-1]:
        t = mx.sort(lp, axis=-1)[..., -params.top_k:][..., :1]  # the k-th largest
        surely, maybe = mx.maximum(surely, t), mx.maximum(maybe, t)
    inv_t = 1 / params.temperature
    return (mx.where(lp >= surely + edge, lp, -math.inf) * inv_t,
            mx.where(lp >= maybe - edge, lp, -math.inf) * inv_t)


def _top_p_threshold(lp: mx.array, top_p: float) -> mx.array:
    """The lowest log-probability mlx-lm's apply_top_p keeps at `top_p` (its own arithmetic): [..., 1]."""
    ascending = mx.sort(lp, axis=-1)
    probs = mx.exp(ascending)
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    dropped = (mass_above >= top_p * (mass_above[..., :1] + probs[..., :1])).sum(axis=-1, keepdims=True)
    return mx.take_along_axis(ascending, dropped, axis=-1)


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
