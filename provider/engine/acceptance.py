"""How drafts are chosen and judged in a speculative round: greedy matching, or speculative sampling.

Greedy: the drafter proposes its argmax. The target keeps the longest prefix that matches its own argmax,
then adds its own next token. The output is token-identical to plain greedy decoding.

Sampled (Leviathan et al. 2023; Chen et al. 2023): the drafter samples d_i from q_i, and the target
accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)). On the first rejection it samples from the
normalised residual max(0, p_i - q_i); when all k are accepted it samples the bonus token from p_k. The
output is then distributed exactly as plain sampling from p. Both p and q are the job's own distribution:
log-softmax, then top_p / min_p / top_k, then temperature, exactly as the plain sampler builds it. Every
draw comes from the job's own PRNG key, so a seeded job reproduces run to run.

Coupled (a seeded job): position j's token is the Gumbel-max draw of the job's seed at j, for the drafter and
the target alike (sampling.perturbed). The target keeps the drafts that equal its own draw, then adds its own
draw at the first that does not. The tokens are then exactly plain sampling's with that seed, so a verifier
replays them (provider.verification); the price is acceptance: a draft is kept when both argmaxes agree, at
most Σ min(p, q) (what speculative sampling keeps) and measured by `provider bench`.

`verify` returns device arrays and never reads back; the round loop reads everything once.
"""

from __future__ import annotations

import mlx.core as mx

from ..jobs import SamplingParams
from ..speculation import GREEDY, SPECULATIVE_SAMPLING
from .sampling import filters_for, job_seed, perturbed, sampling_scores


def greedy_tokens(logits: mx.array, limit: int | None = None) -> mx.array:
    """Argmax exactly as mlx-lm's plain path takes it (over log-probabilities), so near-ties break alike;
    over the ids below `limit` (those the detokenizer can decode) when the model scores more."""
    logits = logits[..., :limit]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


class GreedyChoice:
    scheme = GREEDY

    def __init__(self, limit: int | None = None):
        self._limit = limit

    def at(self, position: int) -> None:
        pass  # greedy tokens depend on no position

    def first(self, logits: mx.array) -> mx.array:
        return greedy_tokens(logits, self._limit)

    def draft(self, logits: mx.array) -> tuple[mx.array, None]:
        return greedy_tokens(logits, self._limit), None

    def verify(self, logits: mx.array, drafts: mx.array, q: list) -> tuple[mx.array, mx.array, dict]:
        """logits [k+1, V] -> (accepted count n, the token after them [1], per-round extras)."""
        verdict = greedy_tokens(logits, self._limit)
        k = drafts.shape[0]
        n = mx.cumprod((verdict[:k] == drafts).astype(mx.int32)).sum()
        return n, mx.take(verdict, n)[None], {}


class SampledChoice:
    scheme = SPECULATIVE_SAMPLING

    def __init__(self, params: SamplingParams, seed: int | None = None, limit: int | None = None):
        self._limit = limit  # p and q both over the decodable ids: the same support, so still exact
        self._filtered = filters_for(params)
        self._inv_temp = 1 / params.temperature
        self._key = mx.random.key(job_seed(params) if seed is None else seed)

    def at(self, position: int) -> None:
        pass  # its draws follow one another from its key, whatever the position

    def _next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def probs(self, logits: mx.array) -> mx.array:
        logits = logits[..., :self._limit].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.softmax(self._filtered(logprobs) * self._inv_temp, axis=-1)

    def first(self, logits: mx.array) -> mx.array:
        return mx.random.categorical(mx.log(self.probs(logits)), key=self._next_key())

    def draft(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        q = self.probs(logits)
        return mx.random.categorical(mx.log(q), key=self._next_key()), q

    def verify(self, logits: mx.array, drafts: mx.array, q: list) -> tuple[mx.array, mx.array, dict]:
        k = drafts.shape[0]
        q = mx.concatenate(q, axis=0)  # [k, V]
        p = self.probs(logits)  # [k+1, V]
        at = drafts[:, None]
        p_d = mx.take_along_axis(p[:k], at, axis=-1)[:, 0]
        q_d = mx.take_along_axis(q, at, axis=-1)[:, 0]  # > 0: each draft was sampled from its q
        u = mx.random.uniform(shape=(k,), key=self._next_key())
        n = mx.cumprod((u * q_d < p_d).astype(mx.int32)).sum()  # u < p/q, without dividing
        # Row i < k: the residual after a rejection at i; row k: p itself, for a bonus after k acceptances.
        rows = mx.concatenate([mx.maximum(p[:k] - q, 0.0), p[k:]], axis=0)
        dist = mx.take(rows, n, axis=0)
        dist = mx.where(dist.sum() > 0, dist, mx.take(p, n, axis=0))  # p == q exactly leaves no residual
        bonus = mx.random.categorical(mx.log(dist), key=self._next_key())
        # Per draft position, the probability this scheme accepts it, Σ min(p, q), and the probability
        # sample-and-compare (mlx-lm's scheme) would, Σ p·q; the round loop counts the positions judged.
        overlap = {"min_overlap": mx.minimum(p[:k], q).sum(axis=-1), "dot_overlap": (p[:k] * q).sum(axis=-1)}
        return n, bonus[None], overlap


class CoupledChoice:
    """Drafts and verdicts drawn with the job's seeded noise at each output position: the round loop says
    which position its next token is (`at`) before the first token and before each round."""

    scheme = SPECULATIVE_SAMPLING

    def __init__(self, params: SamplingParams, seed: int, limit: int | None = None):
        self._params, self._seed, self._limit = params, seed, limit
        self._position = 0
        self._drafted = 0

    def at(self, position: int) -> None:
        self._position, self._drafted = position, 0

    def _draw(self, logits: mx.array, position: int) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(perturbed(sampling_scores(logprobs, self._params, self._limit), self._seed, position),
                         axis=-1)

    def first(self, logits: mx.array) -> mx.array:
        return self._draw(logits, self._position)

    def draft(self, logits: mx.array) -> tuple[mx.array, None]:
        self._drafted += 1
        return self._draw(logits, self._position + self._drafted - 1), None

    def verify(self, logits: mx.array, drafts: mx.array, q: list) -> tuple[mx.array, mx.array, dict]:
        k = drafts.shape[0]
        verdict = mx.concatenate([self._draw(logits[i:i + 1], self._position + i) for i in range(k + 1)])
        n = mx.cumprod((verdict[:k] == drafts).astype(mx.int32)).sum()
        return n, mx.take(verdict, n)[None], {}


def choice_for(params: SamplingParams, limit: int | None = None,
               seed: int | None = None) -> GreedyChoice | SampledChoice | CoupledChoice:
    """Greedy matching; coupled draws for a seeded job (`seed`: the job's own, or the one it was given);
    speculative sampling for one nobody will replay."""
    if params.greedy:
        return GreedyChoice(limit)
    return CoupledChoice(params, seed, limit) if seed is not None else SampledChoice(params, limit=limit)


def draw_drafts(rows: list, logits: mx.array, qs: list[list], select=None) -> mx.array:
    """Each row's (spec_rounds.SpecRow) draft from its own logits [B, V], by its own choice; returns the drafts
    [B, 1], and adds each row's q to its list in `qs`. A constrained row drafts under its grammar's mask, and the
    grammar takes the draft at once (the next mask depends on it): its draft is read back here, one sync per draft
    position. `select(i, logits [1, V])`: what row i's draft is drawn from, given its (masked) logits (a DFlash2
    drafter's candidates). Every drafter draws through here."""
    tokens = []
    for i, row in enumerate(rows):
        own = logits[i:i + 1] if row.grammar is None else row.grammar.draft(logits[i:i + 1])
        token, q = row.choice.draft(own if select is None else select(i, own))
        if row.grammar is not None:
            row.grammar.drafted(token.item())
        tokens.append(token)
        qs[i].append(q)
    return mx.concatenate(tokens)[:, None]
