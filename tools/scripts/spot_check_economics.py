"""Spot-check economics (issue 55): how many jobs until a cheater is caught, and what checking costs.

A coordinator verifies a fraction f of finished jobs; a checked cheating job fails with probability p (the
verifier's detection rate for that cheat); a cheater cheats on a share s of its jobs. Each job then exposes it
with probability q = f*p*s, independently, so the jobs until its first failed check are geometric:

    n99 = ceil(ln(0.01) / ln(1 - f*p*s))   jobs until caught with 99% confidence
    cost = f * c                            verification's share of the network's compute,

c being a verify job's cost over the generation it checks (0.2 on this CPU, docs/verification.md; ~0.01 on a
GPU, as TOPLOC's ~100x implies).

Printed: (a) the closed form for f in --fraction, p in {0.999, 0.5}, s in {1, 0.1, 0.01}; (b) a simulation
that drives the reference coordinator's own spot-check code (coordinator_client/spot_checks.py): 90 honest
nodes and 10 cheaters serve jobs round-robin; `SpotChecks.pick` decides each job's check, and each check's
verdict goes through `SpotChecks.sent` and `SpotChecks.answered` into its producer's `Tally`. A cheater is
caught at its first `failed` in the tally (and leaves); honest nodes serve --honest-jobs each. Per s: the median
and 99th percentile of a cheater's jobs until caught against the closed form, the honest nodes failed (must be
0; exit 1 otherwise) and the network's verification cost. No models, no network; ~26 s of CPU, ~18 s on 2 idle cores.

    python tools/scripts/spot_check_economics.py [--fraction 0.01 0.02 0.05 0.1] [--trials 200] [--seed 55]
        [--cost 0.2] [--detect 0.999] [--honest-jobs 50]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coordinator_client.pb import provider_pb2 as pb  # noqa: E402
from coordinator_client.spot_checks import VERIFY_PREFIX, SpotChecks  # noqa: E402

FRACTIONS = (0.01, 0.02, 0.05, 0.1)
DETECTS = (0.999, 0.5)
SHARES = (1.0, 0.1, 0.01)
CHEATERS = (1.0,) * 3 + (0.1,) * 3 + (0.01,) * 4  # 10 cheaters, 3-4 per share: trials x 3-4 samples each
HONEST = 90
GPU_COST = 0.01
CAP = 20  # a cheater still uncaught after 20 x n99 jobs (chance 1e-40) counts as never caught


def n_caught(f: float, p: float, s: float, confidence: float = 0.99) -> float:
    """Jobs until a cheater is caught with this confidence (the geometric law's quantile); inf if never."""
    q = f * p * s
    return math.ceil(math.log(1 - confidence) / math.log1p(-q)) if q > 0 else math.inf


def closed_form_table(fractions, cost: float) -> str:
    head = f"{'f':>5} {'p':>6} | " + " ".join(f"{'s=' + str(s):>8}" for s in SHARES)
    head += f" | {'cost f*c (c=' + str(cost) + ')':>18} {'GPU f*' + str(GPU_COST):>10}"
    lines = [head, "-" * len(head)]
    for f in fractions:
        for p in DETECTS:
            row = f"{f:>5} {p:>6} | " + " ".join(f"{n_caught(f, p, s):>8,}" for s in SHARES)
            lines.append(row + f" | {f * cost:>18.2%} {f * GPU_COST:>10.2%}")
    return "\n".join(lines)


@dataclass
class Outcome:
    """One verify fraction's simulation, over all its trials."""

    fraction: float
    caught: dict[float, list[float]] = field(default_factory=dict)  # share -> each cheater's jobs until caught
    honest_jobs: int = 0
    honest_failed: int = 0
    jobs: int = 0
    checked: int = 0


def simulate(fraction: float, detect: float, trials: int, seed: int, honest_jobs: int = 50, honest: int = HONEST,
             cheaters=CHEATERS, spot_checks=SpotChecks) -> Outcome:
    """`trials` networks of `honest` honest nodes and a cheater for each share in `cheaters`, checked by
    `spot_checks` (the reference coordinator's SpotChecks; the tests pass broken ones)."""
    if not (fraction * detect > 0 and all(s > 0 for s in cheaters)):
        raise ValueError("with f, p or s at 0 a cheater is never caught: nothing to simulate")
    out = Outcome(fraction, {s: [] for s in set(cheaters)})
    seeds = random.Random(f"{seed}/{fraction}/{detect}")
    for _ in range(trials):
        spot = spot_checks(fraction, seed=seeds.getrandbits(64))
        rng = random.Random(seeds.getrandbits(64))  # the cheats and their detection, apart from the picks
        limit = {s: CAP * n_caught(fraction, detect, s) for s in set(cheaters)}
        nodes = [[f"honest-{i}", 0.0, honest_jobs, 0] for i in range(honest)]  # name, share, jobs, served
        nodes += [[f"cheat-{i}", s, limit[s], 0] for i, s in enumerate(cheaters)]
        active = nodes
        while active:  # a round: every node still serving finishes one job
            still = []
            for n in active:
                node, share, jobs, served = n
                n[3] = served = served + 1
                job_id = f"{node}/{served}"
                cheated = share > 0 and rng.random() < share
                if spot.pick(job_id):
                    passed = not (cheated and rng.random() < detect)
                    verify_id = VERIFY_PREFIX + job_id
                    spot.sent(verify_id, node, job_id)
                    spot.answered(pb.ProviderFrame(job_done=pb.JobDone(
                        job_id=verify_id, verdict=pb.Verdict(passed=passed, reason="" if passed else "cheat"))))
                    if getattr(spot.tally.get(node), "failed", 0):  # caught: the network drops it
                        if share > 0:
                            out.caught[share].append(served)
                        continue
                if served < jobs:
                    still.append(n)
                elif share > 0:
                    out.caught[share].append(math.inf)
            active = still
        out.jobs += sum(n[3] for n in nodes)
        out.honest_jobs += honest * honest_jobs
        out.checked += sum(t.checked for t in spot.tally.values())
        out.honest_failed += sum(spot.tally[n].failed for n, s, _, _ in nodes if s == 0 and n in spot.tally)
    return out


def quantile(xs: list[float], q: float) -> float:
    # inverted_cdf picks a sample, so an uncaught cheater (inf) shows as inf instead of breaking interpolation
    return float(np.quantile(np.array(xs, dtype=float), q, method="inverted_cdf"))


def report(o: Outcome, detect: float, cost: float) -> list[str]:
    lines = []
    for s in sorted(o.caught, reverse=True):
        xs, n50, n99 = o.caught[s], n_caught(o.fraction, detect, s, 0.5), n_caught(o.fraction, detect, s)
        med, p99 = quantile(xs, 0.5), quantile(xs, 0.99)
        lines.append(f"{o.fraction:>5} {s:>5} {len(xs):>6} | {med:>9,.0f} {n50:>9,} | {p99:>9,.0f} {n99:>9,}"
                     f" {p99 / n99:>7.2f} | {sum(math.isinf(x) for x in xs):>8}")
    share = o.checked / o.jobs
    lines.append(f"{'':>5} honest: {o.honest_jobs:,} jobs, {o.honest_failed} failed; network: {o.jobs:,} jobs, "
                 f"{share:.2%} checked, x c = {share * cost:.2%} of compute (x {GPU_COST}: {share * GPU_COST:.3%})")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fraction", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=55)
    ap.add_argument("--cost", type=float, default=0.2, help="verify cost / generate cost (0.18-0.24 on this CPU)")
    ap.add_argument("--detect", type=float, default=0.999, help="p in the simulation")
    ap.add_argument("--honest-jobs", type=int, default=50, help="jobs each honest node serves per trial")
    args = ap.parse_args()

    print("Closed form: n99 = ceil(ln 0.01 / ln(1 - f*p*s)) jobs until caught at 99%; cost = f*c\n")
    print(closed_form_table(args.fraction, args.cost))

    print(f"\nSimulation through coordinator_client.spot_checks: {HONEST} honest nodes x {args.honest_jobs} jobs, "
          f"{len(CHEATERS)} cheaters (s = {', '.join(f'{s} x{CHEATERS.count(s)}' for s in SHARES)}), "
          f"p = {args.detect}, {args.trials} trials, seed {args.seed}\n")
    head = (f"{'f':>5} {'s':>5} {'n':>6} | {'median':>9} {'closed':>9} | {'p99':>9} {'n99':>9} {'p99/n99':>7}"
            f" | {'uncaught':>8}")
    print(head + "\n" + "-" * len(head))
    run = partial(simulate, detect=args.detect, trials=args.trials, seed=args.seed, honest_jobs=args.honest_jobs)
    with ProcessPoolExecutor(max_workers=2) as pool:  # fractions in parallel on 2 cores
        outcomes = list(pool.map(run, args.fraction))
    for o in outcomes:
        print("\n".join(report(o, args.detect, args.cost)))
    false = sum(o.honest_failed for o in outcomes)
    print(f"\nfalse accusations of honest nodes: {false}")
    return 1 if false else 0


if __name__ == "__main__":
    sys.exit(main())
