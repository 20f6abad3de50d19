"""Is sampled speculation lossless? The first tokens' distributions, speculative vs plain, side by side.

    python tools/bench/spec_distribution.py --k 1                 # the suite's test: demo pair, T = 0.7, 2,000 a side
    python tools/bench/spec_distribution.py --samples 500 --temperature 1.0
    python tools/bench/spec_distribution.py --grammar --k 2 --samples 800 --positions 5 --seed 20000
        # under a grammar of lowercase words (the assistant drafting under its masks) vs constrained plain sampling

The method is tools/harness/distribution.py's (the suite runs the same test, smaller).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.jobs import SamplingParams  # noqa: E402
from tools.harness.distribution import (PROMPT, AcceptEveryDraft, compare, load_demo_pair,  # noqa: E402
                                        plain_samples, speculative_samples)


def lowercase_words(tok):
    """A fresh row grammar per call: `start: /[a-z ]{1,60}/` over the demo target's vocabulary."""
    import json

    from provider.engine.grammar import RowGrammar
    from provider.engine.grammar_compile import Compiler
    from provider.models.capability import vocab_size
    from provider.models.default import DEMO_TARGET

    width = vocab_size(json.loads((DEMO_TARGET / "config.json").read_text()))
    compiler = Compiler(tok, width)
    return lambda: RowGrammar(compiler.matcher("start: /[a-z ]{1,60}/", "response_format"), width, width,
                              set(tok.eos_token_ids), "lark")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--biased-samples", type=int, default=500)
    ap.add_argument("--positions", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seed", type=int, default=10_000, help="the first speculative row's seed (one per sample)")
    ap.add_argument("--grammar", action="store_true", help="both sides under a Lark grammar of lowercase words")
    args = ap.parse_args()
    if args.samples < 10 or args.positions < 1 or args.k < 1 or not 0 < args.temperature <= 2:
        ap.error("--samples ≥ 10, --positions ≥ 1, --k ≥ 1, 0 < --temperature ≤ 2")
    model, tok, make_drafter = load_demo_pair()
    grammar = lowercase_words(tok) if args.grammar else None
    prompt = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=args.positions, temperature=args.temperature, seed=1)
    t0 = time.perf_counter()
    plain = plain_samples(model, prompt, params, args.samples, args.positions, grammar=grammar)
    spec, stats = speculative_samples(model, make_drafter, prompt, params, args.samples, args.positions, args.k,
                                      seed0=args.seed, grammar=grammar)
    print(f"demo pair{' under a grammar' if grammar else ''}, T = {args.temperature}, k = {args.k}, "
          f"{args.samples} samples a side "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"acceptance per judged draft: {stats.accepted / stats.judged:.3f} measured; expected "
          f"Σ min(p, q) = {stats.min_overlap / stats.judged:.3f} (this scheme), "
          f"Σ p·q = {stats.dot_overlap / stats.judged:.3f} (sample-and-compare, mlx-lm's)")
    print(f"{'position':>8} {'chi2':>8} {'dof':>4} {'p':>9} {'TV':>7}")
    rows = compare(plain, spec, args.positions)
    for r in rows:
        print(f"{r['position']:>8} {r['chi2']:>8} {r['dof']:>4} {r['p']:>9.4f} {r['tv']:>7}")
    biased, _ = speculative_samples(model, make_drafter, prompt, params, args.biased_samples, args.positions,
                                    args.k, choice=AcceptEveryDraft, seed0=10**6, grammar=grammar)
    rejected = min(r["p"] for r in compare(plain, biased, args.positions))
    print(f"biased sampler ({args.biased_samples} samples): smallest p = {rejected:.2e} "
          f"({'rejected' if rejected < 1e-3 else 'NOT rejected'} at 0.001)")
    ok = all(r["p"] >= 1e-3 for r in rows) and rejected < 1e-3
    print("verdict:", "lossless within the test's power" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
