"""Memory given back after an unload, through the real daemon: what an operator sees in `top`.

A daemon serves its default model (the bundled one); a second model (default: the ~100M fixture, ~400 MiB of
float32 weights) is loaded, serves a few requests, and is unloaded, `--rounds` times: by `provider models
unload`, by its idle timeout, and by a request's keep_alive 0 in turn. Before the first load (the idle
baseline), with the model loaded, and after each unload, the daemon's RSS and MLX's active and cache memory
are sampled; the script prints what each unload left above the baseline, as a share of what the load took.

    python tools/bench/bench_unload.py [--model PATH] [--rounds 3] [--requests 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.fixtures import factory  # noqa: E402
from provider.models.default import ensure_default_model  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

MiB = 1 << 20
HOW = ("cli", "idle_timeout", "keep_alive_0")


def sample(server: LocalServer) -> dict[str, int]:
    """The lowest of five samples a tenth of a second apart (one taken mid-step sees its scratch)."""
    rows = []
    for _ in range(5):
        mem = httpx.get(f"{server.url}/health", timeout=30).json()["memory"]
        rows.append({"rss": psutil.Process(server.proc.pid).memory_info().rss, "active": mem["mlx_active_bytes"]})
        time.sleep(0.1)
    return {k: min(r[k] for r in rows) for k in rows[0]}


def resident(server: LocalServer) -> set[str]:
    return {m["id"] for m in httpx.get(f"{server.url}/health", timeout=30).json()["resident"]}


def serve(server: LocalServer, requests: int, **extra) -> None:
    for i in range(requests):
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=300, json={
            "model": "big", "messages": [{"role": "user", "content": f"request {i}: say something"}],
            "max_tokens": 16} | (extra if i == requests - 1 else {}))
        r.raise_for_status()


def until_gone(server: LocalServer, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while "big" in resident(server):
        if time.monotonic() > deadline:
            raise TimeoutError("the model was not unloaded")
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="the model to load and unload (default: the ~100M fixture)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        model = args.model
        if model is None:
            model = home / "llama-100m"
            factory.make_llama_100m(model)
        config = home / "config.toml"
        config.write_text(f'[models.big]\nsource = "{model}"\nidle_timeout_s = 2\n')
        server = LocalServer(ensure_default_model(), home, "--config", str(config))
        try:
            serve_default = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, json=serve_default,
                       timeout=120).raise_for_status()
            base = sample(server)
            rows = []
            for r in range(args.rounds):
                for how in HOW:
                    serve(server, args.requests, **({"keep_alive": 0} if how == "keep_alive_0" else {}))
                    loaded = sample(server) if "big" in resident(server) else None
                    if how == "cli":
                        out = subprocess.run([sys.executable, "-m", "provider", "models", "unload", "big"],
                                             env=server.env, capture_output=True, text=True, timeout=120)
                        if out.returncode != 0:
                            raise SystemExit(f"unload failed: {out.stderr}")
                    until_gone(server)
                    after = sample(server)
                    row = {"round": r, "how": how, **{f"{k}_left_mib": round((after[k] - base[k]) / MiB, 1)
                                                       for k in base}}
                    if loaded is not None:
                        row |= {f"{k}_loaded_mib": round((loaded[k] - base[k]) / MiB, 1) for k in base}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            server.stop()
    took = max(r.get("rss_loaded_mib", 0) for r in rows)
    worst_rss = max(r["rss_left_mib"] for r in rows)
    worst_active = max(r["active_left_mib"] for r in rows)
    print(f"\nmodel loaded: RSS +{took:.1f} MiB over the idle baseline ({base['rss'] / MiB:.0f} MiB)")
    print(f"after an unload, worst of {len(rows)}: RSS +{worst_rss:.1f} MiB ({worst_rss / max(took, 1e-9):.1%} of "
          f"what the load took), MLX active +{worst_active:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
