"""Decode tokens/s of the local node (HTTP streaming) vs bare mlx_lm.stream_generate, side by side.

Both run greedy on the same model and prompt, alternating A/B for several rounds
so machine noise hits both alike; the ratio of medians is printed.

    python tools/bench/bench_local.py [--model PATH] [--tokens 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.models.default import ensure_default_model  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

PROMPT = "The provider node serves language models to a network of clients."


def bare_mlx_lm(model, tok, prompt_ids: list[int], n: int) -> tuple[float, int]:
    from mlx_lm.generate import stream_generate

    first = last = None
    count = 0
    for _ in stream_generate(model, tok, prompt_ids, max_tokens=n):
        now = time.perf_counter()
        first = first or now
        last = now
        count += 1
    return (count - 1) / (last - first), count


def through_node(url: str, headers: dict, model_id: str, n: int) -> tuple[float, int, float]:
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True}
    first = last = None
    tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or now
                last = now
            if "usage" in chunk:
                last, tokens = now, chunk["usage"]["completion_tokens"]
                engine_rate = chunk["telemetry"]["decode_tokens_per_s"]
    return (tokens - 1) / (last - first), tokens, engine_rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the bundled default model)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()

    from mlx_lm import load

    path = args.model or ensure_default_model()
    model, tok = load(str(path))
    prompt_ids = tok.encode(PROMPT)
    home = Path(tempfile.mkdtemp(prefix="bench-local-"))
    server = LocalServer(path, home, "--no-auth")
    try:
        bare_mlx_lm(model, tok, prompt_ids, 16)  # warm both sides
        through_node(server.url, server.headers, path.name, 16)
        node_rates, bare_rates = [], []
        for i in range(args.rounds):
            rate_b, n_b = bare_mlx_lm(model, tok, prompt_ids, args.tokens)
            rate_n, n_n, engine_rate = through_node(server.url, server.headers, path.name, args.tokens)
            bare_rates.append(rate_b)
            node_rates.append(rate_n)
            print(f"round {i + 1}: mlx_lm {rate_b:8.1f} tok/s ({n_b} tokens)   "
                  f"local node {rate_n:8.1f} tok/s ({n_n} tokens; engine telemetry {engine_rate:.1f})")
    finally:
        server.stop()
    bare, node = statistics.median(bare_rates), statistics.median(node_rates)
    print(f"model: {path}")
    print(f"median decode tokens/s: bare mlx_lm.stream_generate {bare:.1f}, local node over HTTP {node:.1f}")
    print(f"ratio local/bare: {node / bare:.3f}  (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
