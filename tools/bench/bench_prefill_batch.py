"""What one forward over waiting prompts costs per token, by how many are read together (issue 28).

mlx_lm.server reads a wave of arrivals in one forward; the node reads them one after another within its step
budget. This prints the cost per prompt token of one forward over B prompts of L tokens on fresh caches (the
model's own forward, as both servers run it), median of 3, so the two ways can be compared on this machine.

    python tools/bench/bench_prefill_batch.py [--model DIR] [--length 128] [--batches 1 2 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

DEMO = Path(__file__).resolve().parents[2] / "provider" / "models" / "demo" / "gemma4-demo"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model, _ = load(str(args.model))

    def forward(batch: int) -> float:
        cache = make_prompt_cache(model)
        tokens = mx.random.randint(10, 200, (batch, args.length))
        start = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        return time.perf_counter() - start

    forward(1)  # warm
    times: dict[int, list[float]] = {b: [] for b in args.batches}
    for _ in range(args.rounds):  # batch sizes alternated, so a slow moment falls on all of them
        for b in args.batches:
            times[b].append(forward(b))
    print(f"model {args.model.name}, prompts of {args.length} tokens, one forward each, median of {args.rounds}")
    base = statistics.median(times[args.batches[0]]) / (args.batches[0] * args.length)
    for b in args.batches:
        per_token = statistics.median(times[b]) / (b * args.length)
        print(f"  B={b}: {per_token * 1e3:.2f} ms/token  ({per_token / base:.3f} of B={args.batches[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
