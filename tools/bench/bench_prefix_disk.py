"""A long prompt after a restart: time to first token with the prefix cache's disk tier against the same
prompt cold, through the real daemon, on the bundled model and the ~100M fixture.

Each round: a daemon on a fresh disk tier reads the prompt (cold: nothing cached), stops; a second daemon on
the same state (a restart) gets the same prompt, its KV read back from disk. Both answers are greedy and must
be identical. The prompt is 4,000 tokens, or as long as the model's context allows. Medians over `--rounds`.

    python tools/bench/bench_prefix_disk.py [--rounds 3] [--tokens 4000] [--skip-100m]
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

from tools.fixtures import factory  # noqa: E402
from provider.memory.checkpoint import context_length, read_config  # noqa: E402
from provider.models.default import ensure_default_model  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

MAX_TOKENS = 8


def first_token(server: LocalServer, prompt: list[int]) -> tuple[float, list[str], dict]:
    """TTFT (s) of one streamed greedy completion of `prompt` (token ids), its text pieces and its usage."""
    body = {"model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, ttft, pieces, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = ttft or time.perf_counter() - t0
                pieces.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    return ttft, pieces, usage


def measure(model: Path, tokens: int, rounds: int) -> dict:
    config = read_config(model)
    n = min(tokens, context_length(config) - MAX_TOKENS - 8)
    vocab = config.get("text_config", config).get("vocab_size") or config["vocab_size"]
    prompt = [(i * 37) % (vocab - 20) + 10 for i in range(n)]
    cold, warm = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            runs = []
            for _restart in range(2):
                server = LocalServer(model, home, "--log-level", "warning")
                try:
                    runs.append(first_token(server, prompt))
                    disk = httpx.get(f"{server.url}/health", timeout=30).json()["prefix_disk"]
                finally:
                    server.stop()
                if _restart == 0 and not disk["writes"] and not list(home.glob("cache/provider/prefix-cache/*")):
                    print(f"nothing written by the first daemon: {disk}; its log: {server.logs()[-2000:]}")
            (t_cold, text_cold, _), (t_warm, text_warm, usage) = runs
            if text_cold != text_warm:
                raise SystemExit(f"outputs differ after the restart: {text_cold} vs {text_warm}")
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            cold.append(t_cold)
            warm.append(t_warm)
            print(json.dumps({"model": model.name, "prompt_tokens": n, "cold_ttft_s": round(t_cold, 3),
                              "restart_ttft_s": round(t_warm, 3), "cached_tokens": cached, "disk": disk}), flush=True)
    return {"model": model.name, "prompt_tokens": n, "cold": statistics.median(cold),
            "warm": statistics.median(warm)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--skip-100m", action="store_true")
    args = ap.parse_args()
    rows = [measure(ensure_default_model(), args.tokens, args.rounds)]
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_100m:
            big = Path(tmp) / "llama-100m"
            factory.make_llama_100m(big)
            rows.append(measure(big, args.tokens, args.rounds))
    print()
    for r in rows:
        print(f"{r['model']:<14} {r['prompt_tokens']:5d}-token prompt: TTFT cold {r['cold'] * 1000:7.0f} ms, after a "
              f"restart {r['warm'] * 1000:6.0f} ms: x{r['warm'] / r['cold']:.3f} (goal <= 0.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
