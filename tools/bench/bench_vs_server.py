"""The node vs `mlx_lm.server` on the same model, same machine, same run: what a user would run instead.

Both servers run at once on loopback, the node at its own step budget (--node-prefill-step, 0: its device
default) and mlx_lm.server at --server-prefill-step (256: the finer of its usual steps, which makes its stalls
shortest); each measurement alternates between them,
`--rounds` times, and the median of each side is printed.

- throughput: aggregate completion tokens/s with c concurrent clients (default sampling, T = 1.0);
- prefix reuse: a ~1,000-token system prompt sent five times with different user turns: time to first
  token of requests 2-5 over request 1's, on each server;
- prefill stall: one stream decoding while another request prefills ~1,500 tokens: the stream's longest
  gap between tokens;
- huge prompt (node only): the same stream's longest gap while a several-MB prompt arrives and is refused.

    python tools/bench/bench_vs_server.py [--model PATH] [--concurrency 1 4 8 16] [--requests 16] [--tokens 64]
                                    [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.models.default import ensure_default_model  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

WORDS = ("cache batch token prompt model stream window prefix memory budget node server request reply "
         "layer weight kernel thread queue step").split()


class Server:
    def __init__(self, name: str, url: str, model: str, headers: dict):
        self.name, self.url, self.model, self.headers = name, url, model, headers

    def complete(self, prompt: str, max_tokens: int, temperature: float = 1.0) -> int:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        r = httpx.post(self.url + "/v1/completions", json=body, headers=self.headers, timeout=900)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    def stream_chat(self, messages: list, max_tokens: int, on_token=None, temperature: float = 0.0) -> float:
        """Stream a chat completion; return the time to its first content token."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "temperature": temperature}
        t0 = time.perf_counter()
        ttft = None
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, headers=self.headers,
                          timeout=900) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    ttft = ttft if ttft is not None else now - t0
                    if on_token:
                        on_token(now)
        return ttft if ttft is not None else float("nan")


def text(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def throughput(server: Server, clients: int, requests: int, tokens: int, rng: random.Random) -> float:
    prompts = [text(rng.randrange(8, 40), rng) for _ in range(requests)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        total = sum(pool.map(lambda p: server.complete(p, tokens), prompts))
    return total / (time.perf_counter() - t0)


def prefix_reuse(server: Server, rng: random.Random) -> float:
    system = {"role": "system", "content": text(520, rng)}  # ~1,000 tokens on the demo tokenizer
    ttfts = [server.stream_chat([system, {"role": "user", "content": f"Question {i}: {text(6, rng)}"}], 4)
             for i in range(5)]
    return statistics.mean(ttfts[1:]) / ttfts[0]


class _Enough(Exception):
    pass


def stall(server: Server, interloper, rng: random.Random) -> float:
    """The longest gap between a stream's tokens while `interloper(server)` runs."""
    stamps: list[float] = []
    window: list[float] = []

    def on_token(now: float) -> None:
        stamps.append(now)
        if len(window) == 2 and now > window[1]:
            raise _Enough  # one token after the interloper ended: hang up

    def consume() -> None:
        try:
            server.stream_chat([{"role": "user", "content": text(10, rng)}], 1500, on_token, 1.0)
        except _Enough:
            pass

    stream = threading.Thread(target=consume)
    stream.start()
    while len(stamps) < 5:
        time.sleep(0.01)
    window.append(time.perf_counter())
    interloper(server)
    window.append(time.perf_counter())
    stream.join()
    inside = [t for t in stamps if window[0] <= t <= window[1]]
    marks = [window[0], *inside, max(window[1], inside[-1] if inside else window[1])]
    following = [t for t in stamps if t > window[1]][:1]  # the first token after the interloper ended
    marks += following
    return max(b - a for a, b in zip(marks, marks[1:]))


def long_prefill(rng: random.Random):
    prompt = text(780, rng)  # ~1,500 tokens
    return lambda server: server.complete(prompt, 1)


def huge_prompt(server: Server) -> None:
    body = {"model": server.model, "prompt": "token " * 800_000, "max_tokens": 4}  # ~4.8 MB
    httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=900)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlx_lm_server(model: Path, port: int, prefill_step: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port),
                             "--prefill-step-size", str(prefill_step)], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc
        except httpx.HTTPError:
            if proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited: {log.read_text()[-2000:]}")
            time.sleep(0.5)
    raise TimeoutError("mlx_lm.server did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per throughput run")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per throughput request")
    ap.add_argument("--node-prefill-step", type=int, default=0)
    ap.add_argument("--server-prefill-step", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = (args.model or ensure_default_model()).resolve()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        node_proc = LocalServer(model, home, "--no-auth", env={"PROVIDER_PREFILL_STEP_SIZE": str(args.node_prefill_step)})
        port = free_port()
        server_proc = start_mlx_lm_server(model, port, args.server_prefill_step, home / "mlx_lm_server.log")
        try:
            node_id = httpx.get(node_proc.url + "/v1/models").json()["data"][0]["id"]
            node = Server("node", node_proc.url, node_id, {})
            server = Server("mlx_lm.server", f"http://127.0.0.1:{port}", str(model), {})
            for s in (node, server):  # warm both up
                s.complete("warm up", 4)
            print(f"model {model.name}; prefill step node {args.node_prefill_step or 'default'}, server "
                  f"{args.server_prefill_step}; {os.cpu_count()} cores")
            print(f"{'measure':34} {'node':>10} {'mlx_lm.server':>14} {'node/server':>12}")

            def row(name, measure, fmt="{:.2f}"):
                pairs = [(measure(node), measure(server)) for _ in range(args.rounds)]
                a, b = (statistics.median(side) for side in zip(*pairs))
                print(f"{name:34} {fmt.format(a):>10} {fmt.format(b):>14} {a / b:>12.2f}", flush=True)

            for c in args.concurrency:
                row(f"aggregate tok/s, c={c}", lambda s: throughput(s, c, max(args.requests, c), args.tokens, rng),
                    "{:.1f}")
            row("TTFT repeat/first, shared system", lambda s: prefix_reuse(s, rng))
            row("longest gap (s), 1.5k-token prefill", lambda s: stall(s, long_prefill(rng), rng))
            huge = statistics.median(stall(node, huge_prompt, rng) for _ in range(args.rounds))
            print(f"{'longest gap (s), 4.8 MB prompt':34} {huge:>10.2f} {'(not run)':>14}")
        finally:
            server_proc.terminate()
            node_proc.stop()
            server_proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
