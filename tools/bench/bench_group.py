"""A node group of two ranks on loopback vs one process, same model, same run (issue 24).

Both serve at once (the group: `provider start --local --group H --rank 0` and `provider start --group H --rank 1`;
the single node: `provider start --local`); each measurement alternates between them, `--rounds` times, and
the medians are printed: aggregate completion tokens/s with c concurrent clients (greedy, every request to
its max_tokens), and each rank's resident weight bytes (its `group_share_loaded` log) against the single
process's. On one machine the two ranks share its cores and talk over loopback, so the tokens/s ratio shows
the group's overhead, not a second machine's speed-up; the weight bytes show what each machine would hold.

    python tools/bench/bench_group.py [--model DIR] [--split auto|tensor|pipeline] [--concurrency 1 8]
                                      [--tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.fixtures import factory  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402
from tools.harness.group import start_group  # noqa: E402

PROMPTS = ["The cache", "Once upon a time", "def main():", "A B C D", "hello hello", "Numbers: 1 2 3",
           "The quick brown fox", "Why is the sky", "Memory is", "Tokens per second", "In the beginning",
           "Layer by layer", "Two machines", "A ring of", "Send and receive", "Sum of all"]


def throughput(server: LocalServer, clients: int, tokens: int, no_end: dict) -> float:
    prompts = PROMPTS[:max(clients, 4)]

    def one(prompt: str) -> int:
        r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=900,
                       json={"prompt": prompt, "max_tokens": tokens, "temperature": 0, "logit_bias": no_end})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(one, prompts))
    return done / (time.perf_counter() - t)


def logged(text: str, event: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and f'"{event}"' in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a checkpoint directory (default: a ~100M-parameter Llama built "
                    "locally by the fixture factory)")
    ap.add_argument("--split", choices=["auto", "tensor", "pipeline"], default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-group-"))
    model = args.model
    if model is None:
        model = work / "llama-100m"
        factory.make_llama_100m(model)
    config = json.loads((model / "config.json").read_text())
    eos = config.get("eos_token_id")
    no_end = {str(t): -100 for t in (eos if isinstance(eos, list) else [eos] if eos is not None else [])}
    whole = sum(p.stat().st_size for p in model.glob("*.safetensors"))

    (work / "single").mkdir()
    single = LocalServer(model, work / "single")
    leader, followers = start_group(model, work / "group", 2, "--group-split", args.split)
    servers = {"one process": single, "group of 2": leader}
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for server in servers.values():
            throughput(server, 1, 4, no_end)  # warm: first forwards, thread pools
        for r in range(args.rounds):
            for c in args.concurrency:
                order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
                for name, server in order:
                    tps = throughput(server, c, args.tokens, no_end)
                    results.setdefault((name, c), []).append(tps)
                    print(f"round {r + 1} c={c} {name}: {tps:.1f} tok/s", file=sys.stderr, flush=True)
        shares = logged(leader.logs(), "group_share_loaded") + [e for f in followers
                                                               for e in logged(f.logs(), "group_share_loaded")]
        single_loaded = logged(single.logs(), "model_loaded")
    finally:
        single.stop()
        leader.stop()
        for f in followers:
            f.proc.wait(30)
            f.stop()

    print(f"\nmodel {model.name}: {whole / 2**20:.1f} MiB of weights on disk; group split "
          f"{shares[0]['split'] if shares else '?'}; {args.tokens} tokens a request, greedy, {args.rounds} rounds "
          "(medians)\n")
    print("| c | one process tok/s | group of 2 tok/s | group ÷ one |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        one, group = (statistics.median(results[(n, c)]) for n in servers)
        print(f"| {c} | {one:.1f} | {group:.1f} | {group / one:.3f} |")
    print("\n| process | resident weight bytes | ÷ one process |")
    print("|---|---|---|")
    measured = single_loaded[0]["measured_weight_bytes"] if single_loaded else whole
    print(f"| one process | {measured:,} | 1.000 |")
    for e in sorted(shares, key=lambda e: e["rank"]):
        print(f"| group rank {e['rank']} | {e['weight_bytes']:,} | {e['weight_bytes'] / measured:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
