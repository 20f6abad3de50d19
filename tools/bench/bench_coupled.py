"""What replayable speculation costs: coupled draws (a seeded job) against speculative sampling (unseeded).

A seeded job that speculates draws the drafter's and the target's tokens with the same noise at each position
and keeps a draft only when the two draws agree (acceptance.CoupledChoice), so its tokens are plain decoding's
with that seed and a verifier replays them exactly. Speculative sampling keeps a draft with probability
min(1, p/q), which keeps more but cannot be replayed. Printed per temperature, side by side in one run (the
same prompts, rounds alternating which goes first): acceptance (accepted ÷ drafted), tokens per target
forward, and decode tokens/s of c concurrent jobs, coupled ÷ unseeded. Plain decoding (speculation off) is
printed for scale.

    python tools/bench/bench_coupled.py [--temperatures 0.3,0.7,1.0] [--concurrency 4] [--tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.jobs import Job, SamplingParams  # noqa: E402
from provider.outputs import Done  # noqa: E402
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET  # noqa: E402
from tools.harness.nodes import make_node  # noqa: E402

PROMPTS = ["The cache", "A river runs through", "def trim(self, n):", "Numbers: 1 2 3 4", "Once upon a time",
           "The weather today", "import numpy as np", "Dear committee,"]
MODES = ("coupled", "unseeded", "plain")


async def _one(node, i: int, mode: str, temperature: float, tokens: int, tag: str) -> Done:
    seed = 1000 + i if mode in ("coupled", "plain") else None
    job = Job(f"{tag}-{i}", "demo", SamplingParams(max_tokens=tokens, temperature=temperature, seed=seed),
              prompt=PROMPTS[i % len(PROMPTS)], speculation="off" if mode == "plain" else "on")
    end = None
    async with node.run(job) as stream:
        async for ev in stream:
            end = ev
    assert isinstance(end, Done), end
    return end


async def _round(node, mode: str, temperature: float, c: int, tokens: int, tag: str) -> tuple[float, list[Done]]:
    t0 = time.perf_counter()
    ends = await asyncio.gather(*(_one(node, i, mode, temperature, tokens, tag) for i in range(c)))
    return sum(e.usage.completion_tokens for e in ends) / (time.perf_counter() - t0), ends


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperatures", default="0.3,0.7,1.0")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.rounds < 1 or args.concurrency < 1:
        ap.error("--rounds and --concurrency must be at least 1")
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} at start; the bundled pair, "
          f"c = {args.concurrency}, {args.tokens} tokens a job", flush=True)
    node = make_node({"demo": DEMO_TARGET}, speculation="on", max_concurrent_jobs=args.concurrency,
                     manager_kw={"drafters": {"demo": DEMO_ASSISTANT}})
    asyncio.run(node.preload("demo"))
    asyncio.run(_round(node, "unseeded", 0.7, 2, 8, "warm"))
    med = statistics.median
    try:
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            spec: dict[str, list] = {m: [] for m in MODES}
            for r in range(args.rounds):
                for mode in MODES[r % 3:] + MODES[:r % 3]:
                    rate, ends = asyncio.run(_round(node, mode, temperature, args.concurrency, args.tokens,
                                                    f"{mode}-{temperature}-{r}"))
                    rates[mode].append(rate)
                    spec[mode] += [e.telemetry.speculation for e in ends]

            def accept(m):
                drafted = sum(s.drafted for s in spec[m])
                return sum(s.accepted for s in spec[m]) / drafted if drafted else 0.0

            def per_forward(m):
                forwards = sum(s.target_forwards for s in spec[m])
                return sum(s.emitted for s in spec[m]) / forwards if forwards else 0.0

            print(f"T {temperature}: acceptance coupled {accept('coupled'):.3f} / unseeded {accept('unseeded'):.3f}; "
                  f"tokens per target forward {per_forward('coupled'):.2f} / {per_forward('unseeded'):.2f}; "
                  f"tok/s coupled {med(rates['coupled']):.1f}, unseeded {med(rates['unseeded']):.1f}, "
                  f"plain {med(rates['plain']):.1f}; coupled ÷ unseeded "
                  f"{med(rates['coupled']) / med(rates['unseeded']):.2f}, coupled ÷ plain "
                  f"{med(rates['coupled']) / med(rates['plain']):.2f}", flush=True)
    finally:
        asyncio.run(node.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
