"""The node vs `mlx_lm.server` under load, as an outside load generator measures it: guidellm's `concurrent`
profile (each stream sends its next request as soon as its last one ends) with synthetic prompts.

guidellm runs from a venv of its own (created on first use in --venv: `pip install guidellm==0.8.1`, about
6 GB with its CUDA torch; never a node dependency). Both servers serve the same checkpoint: the bundled model,
a directory, or `llama-100m` (a ~100M-parameter Llama the fixture factory builds here). Each runs at its own
default prefill step unless told (--node-prefill-step: the node's step budget, 0 for its device default;
--server-prefill-step: mlx_lm.server's, 2048 by default). They are measured alternately, the first one
swapped every round; each (prompt length, concurrency) cell gets --requests requests per round, after a short
warm-up request to each. Printed per cell: the medians over rounds of output tok/s, TTFT p50/p95 and ITL
p50/p95 (guidellm's: a request's mean gap between tokens) for both, and the ratios node / server (tok/s:
higher is better; the others: lower is better).

    python tools/bench/bench_guidellm.py [--model PATH | llama-100m] [--prompt-tokens 128 512 2048]
                                         [--concurrency 1 4 8 16] [--requests 32] [--output-tokens 32] [--rounds 3] [--venv DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.models.default import ensure_default_model  # noqa: E402
from tools.fixtures.factory import make_llama_100m  # noqa: E402
from tools.bench.bench_vs_server import free_port, start_mlx_lm_server  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

GUIDELLM = "guidellm==0.8.1"
METRICS = ("tok/s", "ttft p50", "ttft p95", "itl p50", "itl p95")


BUILT = {"llama-100m": make_llama_100m}  # --model NAME: built locally by the fixture factory


def built_model(name: str) -> Path:
    out = Path(tempfile.gettempdir()) / f"provider-bench-{name}"
    if not (out / "model.safetensors").exists():
        BUILT[name](out)
    return out


def guidellm_venv(venv: Path) -> Path:
    exe = venv / "bin" / "guidellm"
    if not exe.exists():
        print(f"creating {venv} with {GUIDELLM} (once; about 6 GB)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", GUIDELLM], check=True)
    return exe


def measure(exe: Path, url: str, model: str, api_key: str, tokenizer: Path, prompt_tokens: int, output_tokens: int,
            concurrency: list[int], requests: int, out: Path) -> dict[int, dict[str, float]]:
    """One guidellm run over every concurrency for one prompt length: {concurrency: metrics}."""
    backend = f"kind=openai_http,target={url},model={model},api_key={api_key or 'none'}"
    cmd = [str(exe), "run", "--backend", backend, "--profile", "kind=concurrent,streams=1",
           "--override", "profile.streams", ",".join(map(str, concurrency)),
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "2"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"guidellm failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    results = {}
    for b in json.loads(out.read_text())["benchmarks"]:
        m = b["metrics"]

        def pct(key: str, p: str) -> float:
            return m[key]["successful"]["percentiles"][p]

        results[b["config"]["strategy"]["streams"]] = {
            "tok/s": m["output_tokens_per_second"]["total"]["mean"],
            "ttft p50": pct("time_to_first_token_ms", "p50"), "ttft p95": pct("time_to_first_token_ms", "p95"),
            "itl p50": pct("inter_token_latency_ms", "p50"), "itl p95": pct("inter_token_latency_ms", "p95")}
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=32, help="requests per cell and round, warmup included")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--node-prefill-step", type=int, default=0)
    ap.add_argument("--server-prefill-step", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "provider-guidellm-venv")
    a = ap.parse_args()
    exe = guidellm_venv(a.venv)
    model = (built_model(a.model.name) if a.model and a.model.name in BUILT else a.model or ensure_default_model()
             ).resolve()
    runs: dict[tuple[str, int, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        node = LocalServer(model, home, env={"PROVIDER_PREFILL_STEP_SIZE": str(a.node_prefill_step),
                                             "PROVIDER_MAX_CONCURRENT_JOBS": str(max(a.concurrency))})
        port = free_port()
        server = start_mlx_lm_server(model, port, a.server_prefill_step, home / "mlx_lm_server.log")
        try:
            node_id = httpx.get(node.url + "/v1/models", headers={"Authorization": f"Bearer {node.token}"}).json()
            sides = {"node": (node.url, node_id["data"][0]["id"], node.token),
                     "server": (f"http://127.0.0.1:{port}", str(model), "")}
            for url, name, key in sides.values():
                httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key or 0}"}, timeout=120,
                           json={"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            for r in range(a.rounds):
                order = ["node", "server"] if r % 2 == 0 else ["server", "node"]
                for p in a.prompt_tokens:
                    for side in order:
                        url, name, key = sides[side]
                        out = home / f"{side}-{p}-{r}.json"
                        for c, metrics in measure(exe, url, name, key, model, p, a.output_tokens, a.concurrency,
                                                  a.requests, out).items():
                            runs.setdefault((side, p, c), []).append(metrics)
                print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
        finally:
            server.terminate()
            node.stop()
    print(f"model {model.name}; guidellm {GUIDELLM.split('==')[1]}, concurrent profile, {a.output_tokens} output "
          f"tokens, {a.requests} requests a cell; medians of {a.rounds} alternating rounds; prefill step node "
          f"{a.node_prefill_step or 'default'}, server {a.server_prefill_step}; times in ms")
    print(f"{'prompt':>6} {'c':>3}  " + "  ".join(f"{k + ' node/server':>28}" for k in METRICS))
    for p in a.prompt_tokens:
        for c in a.concurrency:
            cells = []
            for k in METRICS:
                node_v, server_v = (statistics.median(m[k] for m in runs[(side, p, c)]) for side in ("node", "server"))
                ratio = node_v / server_v if server_v else float("nan")
                cells.append(f"{node_v:9.1f} {server_v:9.1f} {ratio:6.2f}")
            print(f"{p:>6} {c:>3}  " + "  ".join(f"{cell:>28}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
