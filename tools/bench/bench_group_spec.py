"""Speculation in a node group of two on loopback beside one process, same head fixture, same run (issue 42).

Both serve with the policy `on`; each request asks `speculation` off or on, so one server gives both sides.
Each measurement alternates group and single node, `--rounds` times, and the medians are printed: aggregate
completion tokens/s with c concurrent clients off and on (greedy; to max_tokens or the end: a logit bias against
the end would turn speculation off), and tokens per target forward on. The drafts are rank 0's on the group and the process's own on the single node, from the same head: equal
tokens per forward say the group drafts as one process does; the tok/s ratios say what speculation gains on each
(on one machine the two ranks share its cores and talk over loopback).

    python tools/bench/bench_group_spec.py [--fixture qwen3_5-mtp-tiny] [--concurrency 1 8] [--tokens 32]
                                           [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.fixtures.mtp import build_head_fixture, train_prompts  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402
from tools.harness.group import start_group  # noqa: E402


def run(server: LocalServer, prompts: list[list[int]], clients: int, tokens: int, speculation: str) -> tuple:
    """Aggregate tokens/s and tokens per target forward of the prompts, `clients` at a time."""
    def one(prompt: list[int]) -> dict:
        r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=900,
                       json={"prompt": prompt, "max_tokens": tokens, "temperature": 0, "speculation": speculation})
        r.raise_for_status()
        return r.json()

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(one, prompts[:clients]))
    seconds = time.perf_counter() - t
    done = sum(g["usage"]["completion_tokens"] for g in got)
    forwards = sum(g["telemetry"]["speculation"].get("target_forwards", 0) for g in got)
    return done / seconds, (done / forwards if forwards else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", default="qwen3_5-mtp-tiny")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-group-spec-"))
    model = build_head_fixture(args.fixture, home / "fixtures")
    prompts = train_prompts()[:8] * 2
    (home / "single").mkdir()
    single = LocalServer(model, home / "single", "--speculation", "on")
    leader, followers = start_group(model, home / "group", 2, "--group-split", "tensor", "--speculation", "on")
    try:
        print(f"{args.fixture}: {args.tokens} tokens a request, medians of {args.rounds} rounds")
        print("| c | side | tok/s off | tok/s on | on ÷ off | tokens per target forward on |")
        print("|---|---|---|---|---|---|")
        for c in args.concurrency:
            got: dict[tuple, list] = {}
            for _ in range(args.rounds):
                for side, server in (("group of 2", leader), ("one process", single)):
                    for spec in ("off", "on"):
                        got.setdefault((side, spec), []).append(run(server, prompts, c, args.tokens, spec))
            for side in ("group of 2", "one process"):
                off = statistics.median(r[0] for r in got[(side, "off")])
                on = statistics.median(r[0] for r in got[(side, "on")])
                per_forward = statistics.median(r[1] for r in got[(side, "on")])
                print(f"| {c} | {side} | {off:.1f} | {on:.1f} | {on / off:.3f} | {per_forward:.3f} |")
    finally:
        leader.stop()
        for f in followers:
            f.proc.wait(30)
            f.stop()
        single.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
