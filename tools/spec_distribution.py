"""Is sampled speculation lossless? The first tokens' distributions, speculative vs plain, side by side.

    python tools/spec_distribution.py --k 1                 # the suite's test: demo pair, T = 0.7, 2,000 a side
    python tools/spec_distribution.py --samples 500 --temperature 1.0

For each of the first `--positions` generated tokens it prints a two-sample chi-square test of homogeneity
(categories with an expected count under 5 pooled), its p-value and the total variation distance. The
same test is then run on a deliberately biased sampler (it accepts every draft), which it must reject. The
plain side is the node's own sampler over a batch of identical rows; the speculative side is the node's
round loop over a batch of rows, one seed per sample.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from provider.engine.acceptance import SampledChoice  # noqa: E402
from provider.engine.sampling import sampler_for  # noqa: E402
from provider.engine.speculative import SpecStats  # noqa: E402
from provider.jobs import SamplingParams  # noqa: E402

PROMPT = "The cache"


class AcceptEveryDraft(SampledChoice):
    """Deliberately biased (for checking that the test has power): it accepts every draft, so where the
    drafter's q differs from the target's p, the drafter's distribution comes out."""

    def verify(self, logits, drafts, q):
        k = drafts.shape[0]
        bonus = mx.random.categorical(mx.log(self.probs(logits)[k]), key=self._next_key())
        return mx.array(k), bonus[None], {}


def plain_samples(model, prompt: list[int], params: SamplingParams, n: int, positions: int,
                  batch: int = 500) -> list[tuple[int, ...]]:
    """`n` independent plain samples of the first `positions` tokens: batches of rows that read the prompt
    once, each then decoding one token per forward and sampling with the node's plain sampler."""
    from mlx_lm.models.cache import make_prompt_cache

    from provider.engine.speculative import merged, prefill

    read = make_prompt_cache(model)
    prefill(model, read, prompt[:-1], 2048)
    out, sample = [], sampler_for(params)
    for start in range(0, n, batch):
        rows = min(batch, n - start)
        cache, x, cols = merged([read] * rows), mx.array([prompt[-1:]] * rows), []
        for _ in range(positions):
            logits = model(x, cache=cache)[:, -1, :].astype(mx.float32)
            y = sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            cols.append(y.tolist())
            x = y[:, None]
        out += list(zip(*cols))
    return out


def speculative_samples(model, make_drafter, prompt: list[int], params: SamplingParams, n: int, positions: int,
                        k: int, choice=SampledChoice, seed0: int = 0,
                        batch: int = 500) -> tuple[list[tuple[int, ...]], SpecStats]:
    """`n` independent speculative samples (seeds seed0, seed0 + 1, ...) of the first `positions` tokens:
    rows of the node's round loop, `batch` at a time, which read the prompt once and then each draft, get
    verified and roll back on their own."""
    from mlx_lm.models.cache import make_prompt_cache

    from provider.engine.speculative import Speculator, prefill

    spec, total, out = Speculator(model, make_drafter()), SpecStats("sampled", k), []
    read = make_prompt_cache(model)
    prefill(model, read, prompt[:-1], 2048)
    for start in range(seed0, seed0 + n, batch):
        seeds = range(start, min(start + batch, seed0 + n))
        # Every row starts from the same read prompt (the first merge copies it); each has its own key.
        rows = [spec.new_row(prompt, stats=SpecStats("sampled", k), choice=choice(params, seed), caches=read,
                             cached=len(prompt) - 1) for seed in seeds]
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

    from provider.engine.drafters import MTPDrafter
    from provider.engine.speculative import Target
    from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
    from provider.models.gemma4_assistant import load_assistant

    model, tok = load(str(DEMO_TARGET))
    assistant = load_assistant(DEMO_ASSISTANT)
    return model, tok, lambda: MTPDrafter(assistant, Target(model))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--biased-samples", type=int, default=500)
    ap.add_argument("--positions", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seed", type=int, default=10_000, help="the first speculative row's seed (one per sample)")
    args = ap.parse_args()
    if args.samples < 10 or args.positions < 1 or args.k < 1 or not 0 < args.temperature <= 2:
        ap.error("--samples ≥ 10, --positions ≥ 1, --k ≥ 1, 0 < --temperature ≤ 2")
    model, tok, make_drafter = load_demo_pair()
    prompt = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=args.positions, temperature=args.temperature, seed=1)
    t0 = time.perf_counter()
    plain = plain_samples(model, prompt, params, args.samples, args.positions)
    spec, stats = speculative_samples(model, make_drafter, prompt, params, args.samples, args.positions, args.k,
                                      seed0=args.seed)
    print(f"demo pair, T = {args.temperature}, k = {args.k}, {args.samples} samples a side "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"acceptance per judged draft: {stats.accepted / stats.judged:.3f} measured; expected "
          f"Σ min(p, q) = {stats.min_overlap / stats.judged:.3f} (this scheme), "
          f"Σ p·q = {stats.dot_overlap / stats.judged:.3f} (sample-and-compare, mlx-lm's)")
    print(f"{'position':>8} {'chi2':>8} {'dof':>4} {'p':>9} {'TV':>7}")
    rows = compare(plain, spec, args.positions)
    for r in rows:
        print(f"{r['position']:>8} {r['chi2']:>8} {r['dof']:>4} {r['p']:>9.4f} {r['tv']:>7}")
    biased, _ = speculative_samples(model, make_drafter, prompt, params, args.biased_samples, args.positions,
                                    args.k, choice=AcceptEveryDraft, seed0=10**6)
    rejected = min(r["p"] for r in compare(plain, biased, args.positions))
    print(f"biased sampler ({args.biased_samples} samples): smallest p = {rejected:.2e} "
          f"({'rejected' if rejected < 1e-3 else 'NOT rejected'} at 0.001)")
    ok = all(r["p"] >= 1e-3 for r in rows) and rejected < 1e-3
    print("verdict:", "lossless within the test's power" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
