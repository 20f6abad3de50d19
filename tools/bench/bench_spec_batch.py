"""Speculation inside the batch: aggregate tokens/s of c concurrent jobs with speculation on, off and auto.

    python tools/bench/bench_spec_batch.py                       # the bundled pair, c = 1, 2, 4, 8, greedy and T = 0.7
    python tools/bench/bench_spec_batch.py --concurrency 4,8 --tokens 48 --rounds 3 --k 2

The node runs in-process with the bundled demo pair (or --model/--drafter). For each concurrency c and each
sampling, c jobs with different prompts start together, with `speculation: on` (all c rows drafted and
verified together), `off` (the plain batch) and `auto` (each job's choice from the costs measured at load,
for the rows it would join), in a rotating order for --rounds rounds so machine noise hits all alike.
Tokens/s is all completion tokens over the wall time from submit to the last job's end; ratios are of the
medians. `accept` and `batch` (mean rows per round) are of the `on` runs; `auto rounds` counts the rounds
auto's jobs speculated, over all rounds. Greedy outputs are also checked equal across the three.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider import logs  # noqa: E402
from provider.jobs import Job, SamplingParams  # noqa: E402
from provider.outputs import Done, Tokens  # noqa: E402
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET  # noqa: E402
from tools.harness.nodes import make_node  # noqa: E402

TOPICS = ["the sea", "a cache", "the moon", "a robot", "bread", "a river", "the city", "a garden",
          "winter", "a library", "the wind", "a train", "music", "a mountain", "the market", "a clock"]


async def one_job(node, job: Job) -> tuple[list[int], dict]:
    """A job's token ids and its speculation telemetry."""
    ids, spec = [], {}
    async with node.run(job) as stream:
        async for ev in stream:
            if isinstance(ev, Tokens):
                ids += ev.token_ids
            elif isinstance(ev, Done):
                spec = ev.telemetry.speculation.as_dict()
    return ids, spec


async def _wave(node, c: int, mode: str, params: SamplingParams, tag: str):
    jobs = [Job(f"{tag}-{mode}-{i}", "demo", params, prompt=f"Once upon a time, {TOPICS[i % len(TOPICS)]}",
                speculation=mode) for i in range(c)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_job(node, j) for j in jobs))
    wall = time.perf_counter() - t0
    return sum(len(ids) for ids, _ in results) / wall, results


async def main_async(args) -> int:
    logs.configure("warning", "console")
    node = make_node({"demo": Path(args.model)}, max_concurrent_jobs=max(args.concurrency),
                     speculation="auto", speculation_k=args.k, manager_kw={"drafters": {"demo": Path(args.drafter)}})
    samplings = {"greedy": SamplingParams(args.tokens, temperature=0.0),
                 f"T={args.temperature}": SamplingParams(args.tokens, temperature=args.temperature)}
    if args.greedy_only:
        del samplings[f"T={args.temperature}"]
    await _wave(node, 1, "off", samplings["greedy"], "warm")  # loads the pair
    print(f"demo pair, k = {args.k}, {args.tokens} tokens a job, {args.rounds} rounds; aggregate tok/s, medians")
    print(f"{'sampling':>9} {'c':>3} {'off':>7} {'on':>7} {'auto':>7} {'on/off':>7} {'auto/off':>8} {'accept':>7} "
          f"{'batch':>6} {'auto rounds':>11}")
    ok = True
    for name, params in samplings.items():
        for c in args.concurrency:
            rates = {"on": [], "off": [], "auto": []}
            accept, batch, rounds = [], [], 0
            for r in range(args.rounds):
                outputs = {}
                order = ("on", "off", "auto")
                for mode in order[r % 3:] + order[:r % 3]:
                    rate, results = await _wave(node, c, mode, params, f"{name}-{c}-{r}")
                    rates[mode].append(rate)
                    outputs[mode] = [ids for ids, _ in results]
                    if mode == "auto":
                        rounds += sum(s.get("rounds", 0) for _, s in results)
                    if mode == "on":
                        accept += [s.get("acceptance_rate", 0.0) for _, s in results]
                        batch += [s.get("mean_batch", 0.0) for _, s in results]
                if params.greedy and not outputs["on"] == outputs["off"] == outputs["auto"]:
                    ok = False
                    print(f"  greedy outputs differ at c = {c}, round {r}")
            on, off, auto = (statistics.median(rates[m]) for m in ("on", "off", "auto"))
            print(f"{name:>9} {c:>3} {off:>7.1f} {on:>7.1f} {auto:>7.1f} {on / off:>7.3f} {auto / off:>8.3f} "
                  f"{statistics.mean(accept):>7.3f} {statistics.mean(batch):>6.2f} {rounds:>11}")
    await node.stop()
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEMO_TARGET))
    ap.add_argument("--drafter", default=str(DEMO_ASSISTANT))
    ap.add_argument("--concurrency", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--greedy-only", action="store_true")
    args = ap.parse_args()
    if min(args.concurrency) < 1 or args.tokens < 1 or args.rounds < 1 or args.k < 1:
        ap.error("--concurrency, --tokens, --rounds and --k must be ≥ 1")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
