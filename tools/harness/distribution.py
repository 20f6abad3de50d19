"""Is sampled speculation lossless? Samples of the first tokens, speculative and plain, and the test that
compares them: shared by tests/test_spec_sampling.py and tools/bench/spec_distribution.py.

Per generated position: a two-sample chi-square test of homogeneity (categories with an expected count
under 5 pooled), its p-value and the total variation distance; `AcceptEveryDraft` is the deliberately
biased sampler the test must reject. The plain side is the node's own sampler over a batch of identical rows; the speculative side is the node's
round loop over a batch of rows, one seed per sample.
"""

from __future__ import annotations

import collections
import math

import mlx.core as mx

from provider.engine.acceptance import SampledChoice
from provider.engine.sampling import sampler_for
from provider.telemetry import SpecTelemetry
from provider.jobs import SamplingParams

PROMPT = "The cache"


class AcceptEveryDraft(SampledChoice):
    """Deliberately biased (for checking that the test has power): it accepts every draft, so where the
    drafter's q differs from the target's p, the drafter's distribution comes out."""

    def verify(self, logits, drafts, q):
        k = drafts.shape[0]
        bonus = mx.random.categorical(mx.log(self.probs(logits)[k]), key=self._next_key())
        return mx.array(k), bonus[None], {}


def plain_samples(model, prompt: list[int], params: SamplingParams, n: int, positions: int,
                  batch: int = 500, grammar=None) -> list[tuple[int, ...]]:
    """`n` independent plain samples of the first `positions` tokens: batches of rows that read the prompt
    once, each then decoding one token per forward and sampling with the node's plain sampler, a seed per row
    (under its own grammar, a fresh `grammar()` per row, when given)."""
    from mlx_lm.models.cache import make_prompt_cache

    from provider.engine.spec_rounds import merged, prefill

    read = make_prompt_cache(model)
    prefill(model, read, prompt[:-1], 2048)
    out = []
    for start in range(0, n, batch):
        rows = min(batch, n - start)
        cache, x, cols = merged([read] * rows), mx.array([prompt[-1:]] * rows), []
        grammars = [grammar() for _ in range(rows)] if grammar else None
        # A seed of its own per row, as every job has: one seed at one position is one draw.
        samplers = [sampler_for(params, seed=(params.seed or 0) * 1_000_003 + start + i) for i in range(rows)]
        for _ in range(positions):
            logits = model(x, cache=cache)[:, -1, :].astype(mx.float32)
            if grammars:
                logits = mx.concatenate([g.mask(logits[i:i + 1]) for i, g in enumerate(grammars)])
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            y = mx.concatenate([sample(logprobs[i:i + 1]) for i, sample in enumerate(samplers)])
            cols.append(y.tolist())
            for g, token in zip(grammars or (), cols[-1]):
                g.consume([token])
            x = y[:, None]
        out += list(zip(*cols))
    return out


def speculative_samples(model, make_drafter, prompt: list[int], params: SamplingParams, n: int, positions: int,
                        k: int, choice=SampledChoice, seed0: int = 0, batch: int = 500,
                        grammar=None) -> tuple[list[tuple[int, ...]], SpecTelemetry]:
    """`n` independent speculative samples (seeds seed0, seed0 + 1, ...) of the first `positions` tokens:
    rows of the node's round loop, `batch` at a time, which read the prompt once and then each draft, get
    verified and roll back on their own."""
    from mlx_lm.models.cache import make_prompt_cache

    from provider.engine.spec_rounds import Speculator, prefill

    spec, total, out = Speculator(model, make_drafter()), SpecTelemetry("sampled", k=k), []
    read = make_prompt_cache(model)
    prefill(model, read, prompt[:-1], 2048)
    for start in range(seed0, seed0 + n, batch):
        seeds = range(start, min(start + batch, seed0 + n))
        # Every row starts from the same read prompt (the first merge copies it); each has its own key.
        rows = [spec.new_row(prompt, stats=SpecTelemetry("sampled", k=k), choice=choice(params, seed), caches=read,
                             cached=len(prompt) - 1, grammar=grammar() if grammar else None) for seed in seeds]
        samples = [[first] for first in spec.begin(rows)]
        while live := [i for i, s in enumerate(samples) if len(s) < positions]:
            for i, tokens in zip(live, spec.round([rows[i] for i in live])):
                samples[i] += tokens
        out += [tuple(s[:positions]) for s in samples]
        for row in rows:
            for name in ("rounds", "drafted", "accepted", "judged", "min_overlap", "dot_overlap"):
                setattr(total, name, getattr(total, name) + getattr(row.stats, name))
    return out, total


def _upper_gamma_regularized(a: float, x: float) -> float:
    """Q(a, x) = Γ(a, x) / Γ(a) (Numerical Recipes: series below a + 1, continued fraction above)."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1 / a
        for i in range(1, 10_000):
            term *= x / (a + i)
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1 - total * math.exp(log_front))
    b, c, d = x + 1 - a, 1 / 1e-300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi_square(a: collections.Counter, b: collections.Counter) -> tuple[float, int, float]:
    """Two-sample test of homogeneity: (statistic, degrees of freedom, p-value)."""
    na, nb = sum(a.values()), sum(b.values())
    total = na + nb
    cells, pooled = [], [0, 0]
    for token in set(a) | set(b):
        col = a[token] + b[token]
        if min(col * na, col * nb) / total < 5:  # too rare to test alone: pooled
            pooled[0] += a[token]
            pooled[1] += b[token]
        else:
            cells.append((a[token], b[token]))
    if min(pooled) > 0 or max(pooled) > 0:
        cells.append(tuple(pooled))
    stat = 0.0
    for ca, cb in cells:
        col = ca + cb
        for observed, n in ((ca, na), (cb, nb)):
            expected = col * n / total
            stat += (observed - expected) ** 2 / expected if expected else 0.0
    dof = max(1, len(cells) - 1)
    return stat, dof, _upper_gamma_regularized(dof / 2, stat / 2)


def total_variation(a: collections.Counter, b: collections.Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[t] / na - b[t] / nb) for t in set(a) | set(b))


def per_position(samples: list[tuple[int, ...]], positions: int) -> list[collections.Counter]:
    return [collections.Counter(s[i] for s in samples if len(s) > i) for i in range(positions)]


def compare(plain, spec, positions: int) -> list[dict]:
    rows = []
    for i, (a, b) in enumerate(zip(per_position(plain, positions), per_position(spec, positions))):
        stat, dof, p = chi_square(a, b)
        rows.append({"position": i + 1, "chi2": round(stat, 2), "dof": dof, "p": p, "tv": round(total_variation(a, b), 4)})
    return rows


def load_demo_pair():
    from mlx_lm import load

    from provider.engine.proposers import MTPDrafter
    from provider.models.gemma4_target import Target
    from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
    from provider.drafters.gemma4_assistant import load_assistant

    model, tok = load(str(DEMO_TARGET))
    assistant = load_assistant(DEMO_ASSISTANT)
    return model, tok, lambda: MTPDrafter(assistant, Target(model))
