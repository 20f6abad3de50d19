"""From launch to answer: `provider generate` (default policy and `--speculation off`) against
`python -m mlx_lm generate`, and the daemon's spawn to first token against `mlx_lm.server` and bare mlx-lm.

What a new user feels before any throughput matters. In one run, alternated (each round runs every command of
a row in a rotated order), `--rounds` times, medians printed side by side with their ratios:

- generate, launch to exit, for 1 and 32 tokens, on the bundled pair (provider/models/demo: `provider generate`
  with no model; mlx-lm on its target) and on a ~100M Llama (the fixture factory's `make_llama_100m`, built
  into a temporary directory);
- daemon, spawn to first streamed token of one chat request: `provider start --local` (on a fixed port, the
  request sent as soon as the port takes it), `mlx_lm.server` the same way, and bare mlx-lm (a Python process
  that loads with `mlx_lm.load` and streams one token with `stream_generate`).

The node runs as a user's would after its first run on this machine: one state directory for every node run
here, its kept speculation profile measured by an untimed first run (whose time is printed apart), its
manifest hashes cached.

    python tools/bench/bench_start.py [--rounds 3] [--tokens 1 32] [--skip-100m] [--skip-daemon] [--skip-generate]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.fixtures import factory  # noqa: E402
from provider.models.default import default_pair  # noqa: E402

PROMPT = "Tell me a short story about a cache that remembered everything."
BARE_MLX_LM = """
import sys
from mlx_lm import load, stream_generate
model, tok = load(sys.argv[1])
prompt = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True)
for r in stream_generate(model, tok, prompt, max_tokens=1):
    print("first token", flush=True)
    break
"""


def provider_cmd() -> list[str]:
    script = Path(sys.executable).parent / "provider"  # the console script a user runs
    return [str(script)] if script.exists() else [sys.executable, "-m", "provider"]


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    return elapsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_token_over_http(proc: subprocess.Popen, port: int, model: str, t0: float, deadline_s: float = 300) -> float:
    """Send one streaming chat request as soon as the port takes it; the time from t0 to its first content."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "stream": True,
            "temperature": 0.0}
    deadline = time.monotonic() + deadline_s
    # One client for every attempt, and a bare connect until the port takes one: a new httpx client per attempt
    # builds an SSL context each time, ~20 ms of this process's CPU every 5 ms, taken from the server it times.
    client = httpx.Client(timeout=deadline_s)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before answering")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=deadline_s).close()
        except OSError:
            time.sleep(0.005)
            continue
        try:
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        elapsed = time.perf_counter() - t0
                        client.close()
                        return elapsed
            raise RuntimeError("the stream ended without content")
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            time.sleep(0.005)
    raise TimeoutError("no first token")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def daemon_first_token(kind: str, model: Path | None, env: dict, log: Path) -> float:
    port = free_port()
    if kind == "provider":
        cmd = provider_cmd() + ["start", "--local", "--port", str(port), "--no-auth", "--log-format", "json"] + \
            (["--model", str(model)] if model is not None else [])
        name = model.name if model is not None else default_pair()[0].name
    else:
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model or default_pair()[0]), "--port", str(port)]
        name = str(model or default_pair()[0])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
    try:
        return first_token_over_http(proc, port, name, t0)
    finally:
        stop(proc)


def bare_first_token(model: Path, env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", BARE_MLX_LM, str(model), PROMPT], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - t0
    proc.wait()
    if "first token" not in line:
        raise RuntimeError(f"bare mlx-lm printed {line!r} (exit {proc.returncode})")
    return elapsed


def rotated(items: list, r: int) -> list:
    r %= len(items)
    return items[r:] + items[:r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--skip-100m", action="store_true")
    ap.add_argument("--skip-daemon", action="store_true")
    ap.add_argument("--skip-generate", action="store_true", help="only the daemon's spawn to first token")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "XDG_STATE_HOME": str(work / "state"),
                        "XDG_CONFIG_HOME": str(work / "config"), "XDG_CACHE_HOME": str(work / "cache")}
    target, assistant = default_pair()
    models: list[tuple[str, Path | None, Path]] = [("bundled pair", None, target)]  # (label, --model, mlx-lm's)
    if not args.skip_100m:
        llama = work / "llama-100m"
        factory.make_llama_100m(llama)
        models.append(("llama-100m", llama, llama))
    load0 = os.getloadavg()
    print(f"{os.cpu_count()} cores; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at start; "
          f"bundled pair {target.name} + {assistant.name if assistant else 'no drafter'}")

    try:
        # The node's first run on this machine: hashes its files and measures the pair's speculation costs (in
        # the background, kept for every later run). Untimed in the table, printed apart.
        for label, model, _ in models:
            first = timed(provider_cmd() + ["generate", PROMPT, "--max-tokens", "1"] +
                          (["--model", str(model)] if model else []), env)
            print(f"first run of provider generate on {label} (hashes, kept profile): {first:.2f} s")
        rows = []
        for label, model, mlx_model in [] if args.skip_generate else models:
            for n in args.tokens:
                base = ["generate", PROMPT, "--max-tokens", str(n)] + (["--model", str(model)] if model else [])
                cmds = {"default": provider_cmd() + base,
                        "off": provider_cmd() + base + ["--speculation", "off"],
                        "mlx_lm": [sys.executable, "-m", "mlx_lm", "generate", "--model", str(mlx_model),
                                   "--prompt", PROMPT, "--max-tokens", str(n)]}
                rows.append((f"generate {label}, {n} token{'s' if n > 1 else ''}", cmds))
        times: dict[str, dict[str, list[float]]] = {title: {} for title, _ in rows}
        daemon_rows = [] if args.skip_daemon else [(label, model, mlx_model) for label, model, mlx_model in models]
        daemon_times: dict[str, dict[str, list[float]]] = {label: {} for label, _, _ in daemon_rows}
        for r in range(args.rounds):
            for title, cmds in rows:
                for name in rotated(list(cmds), r):
                    times[title].setdefault(name, []).append(timed(cmds[name], env))
            for label, model, mlx_model in daemon_rows:
                runs = {"provider": lambda: daemon_first_token("provider", model, env, work / "provider.log"),
                        "mlx_lm.server": lambda: daemon_first_token("mlx_lm.server", mlx_model, env,
                                                                    work / "mlx_lm_server.log"),
                        "bare mlx-lm": lambda: bare_first_token(mlx_model, env)}
                for name in rotated(list(runs), r):
                    daemon_times[label].setdefault(name, []).append(runs[name]())
            print(f"round {r + 1}/{args.rounds} done", flush=True)

        med = statistics.median
        if rows:
            print(f"\nlaunch to exit, median of {args.rounds} (s)")
            print(f"{'':34} {'default':>8} {'off':>8} {'mlx_lm':>8} {'default/mlx_lm':>15} {'off/mlx_lm':>11}")
        for title, _ in rows:
            t = {k: med(v) for k, v in times[title].items()}
            print(f"{title:34} {t['default']:8.2f} {t['off']:8.2f} {t['mlx_lm']:8.2f} "
                  f"{t['default'] / t['mlx_lm']:15.2f} {t['off'] / t['mlx_lm']:11.2f}")
        if daemon_rows:
            print(f"\nspawn to first token, median of {args.rounds} (s)")
            print(f"{'':34} {'provider':>8} {'mlx_lm.server':>14} {'bare mlx-lm':>12} {'vs server':>10} "
                  f"{'vs bare':>8}")
            for label, _, _ in daemon_rows:
                t = {k: med(v) for k, v in daemon_times[label].items()}
                print(f"{'daemon ' + label:34} {t['provider']:8.2f} {t['mlx_lm.server']:14.2f} "
                      f"{t['bare mlx-lm']:12.2f} {t['provider'] / t['mlx_lm.server']:10.2f} "
                      f"{t['provider'] / t['bare mlx-lm']:8.2f}")
        load1 = os.getloadavg()
        print(f"\nload average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end")
        print(json.dumps({"generate": times, "daemon": daemon_times}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
