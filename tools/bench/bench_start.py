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

Both sides run in a venv installed as the README installs the node (`pip install -e .`: no torch, which the
dev venv's `parity` extra brings and transformers then imports on both sides, about a second each, hiding the
ratio): `--python VENV/bin/python`, or by default a venv kept in $XDG_CACHE_HOME/provider-node/bench-venv (made,
or brought up to this checkout, with `pip install -e REPO` when needed; said when it is). The commands run as a
user's would: with bytecode written (PYTHONDONTWRITEBYTECODE is dropped from their environment; with it, the
node's ~100 modules compile on every launch while mlx-lm's come compiled by pip), and after the node's first run
on this machine: one state directory for every node run here, its kept speculation profile measured by an
untimed first run (whose time is printed apart, as is mlx-lm's first), its manifest hashes cached.

    python tools/bench/bench_start.py [--python VENV/bin/python] [--rounds 3] [--prompt TEXT] [--tokens 1 32]
                                      [--skip-100m] [--skip-daemon] [--skip-generate]

Issue 57's measure (the one-shot start on the bundled pair, alternated): `--prompt Hi --tokens 1 --skip-100m
--skip-daemon --rounds 10`.
"""

from __future__ import annotations

import argparse
import hashlib
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

REPO = Path(__file__).resolve().parents[2]
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


PYTHON = sys.executable  # the measured venv's interpreter (main sets it): the node's and mlx-lm's commands run there


def provider_cmd() -> list[str]:
    script = Path(PYTHON).parent / "provider"  # the console script a user runs
    return [str(script)] if script.exists() else [PYTHON, "-m", "provider"]


def default_venv() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "provider-node" / "bench-venv"


def user_venv(venv: Path) -> str:
    """The interpreter of a venv installed as the README says (`pip install -e REPO`), made or brought up to this
    checkout when its stamp (this repo's path and its pyproject.toml) differs."""
    python = venv / "bin" / "python"
    stamp = venv / "provider-bench-stamp"
    want = f"{REPO}\n{hashlib.sha256((REPO / 'pyproject.toml').read_bytes()).hexdigest()}\n"
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        return str(python)
    print(f"installing the node into {venv} as the README does (python -m venv; pip install -e {REPO}): "
          "this takes minutes the first time", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", str(REPO)], check=True)
    stamp.write_text(want)
    return str(python)


def has_torch(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    return subprocess.run([python, "-c", probe]).returncode == 0


CPU: dict[str, dict[str, list[float]]] = {}  # per generate row and command, each run's CPU (user + system) in s


def timed(cmd: list[str], env: dict, cpu: list[float] | None = None) -> float:
    """Launch to exit in s; the run's CPU time (user + system, its children's included) appended to `cpu`."""
    before = os.times()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    after = os.times()
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    if cpu is not None:
        cpu.append(after.children_user - before.children_user + after.children_system - before.children_system)
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
        cmd = [PYTHON, "-m", "mlx_lm.server", "--model", str(model or default_pair()[0]), "--port", str(port)]
        name = str(model or default_pair()[0])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
    try:
        return first_token_over_http(proc, port, name, t0)
    finally:
        stop(proc)


def bare_first_token(model: Path, env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([PYTHON, "-c", BARE_MLX_LM, str(model), PROMPT], env=env,
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
    global PYTHON
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", help="the interpreter of a venv with the node installed as the README does "
                    "(default: one kept in $XDG_CACHE_HOME/provider-node/bench-venv, made when missing)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT, help="of the generate rows (default: a short story's request)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--skip-100m", action="store_true")
    ap.add_argument("--skip-daemon", action="store_true")
    ap.add_argument("--skip-generate", action="store_true", help="only the daemon's spawn to first token")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    PYTHON = args.python or user_venv(default_venv())
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "XDG_STATE_HOME": str(work / "state"),
                        "XDG_CONFIG_HOME": str(work / "config"), "XDG_CACHE_HOME": str(work / "cache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's Python keeps the node's bytecode, as pip's keeps mlx-lm's
    target, assistant = default_pair()
    models: list[tuple[str, Path | None, Path]] = [("bundled pair", None, target)]  # (label, --model, mlx-lm's)
    if not args.skip_100m:
        llama = work / "llama-100m"
        factory.make_llama_100m(llama)
        models.append(("llama-100m", llama, llama))
    load0 = os.getloadavg()
    print(f"{os.cpu_count()} cores; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at start; "
          f"bundled pair {target.name} + {assistant.name if assistant else 'no drafter'}")
    torch = "installed: transformers imports it on both sides" if has_torch(PYTHON) else "absent, as a user's"
    print(f"measured in {PYTHON} (torch {torch})")

    try:
        # The node's first run on this machine: hashes its files and measures the pair's speculation costs (in
        # the background, kept for every later run). Untimed in the table, printed apart.
        for label, model, mlx_model in models:
            first = timed(provider_cmd() + ["generate", args.prompt, "--max-tokens", "1"] +
                          (["--model", str(model)] if model else []), env)
            print(f"first run of provider generate on {label} (bytecode, hashes, kept profile): {first:.2f} s")
            first = timed([PYTHON, "-m", "mlx_lm", "generate", "--model", str(mlx_model), "--prompt", args.prompt,
                           "--max-tokens", "1"], env)
            print(f"first run of mlx_lm generate on {label}: {first:.2f} s")
        rows = []
        for label, model, mlx_model in [] if args.skip_generate else models:
            for n in args.tokens:
                base = ["generate", args.prompt, "--max-tokens", str(n)] + (["--model", str(model)] if model else [])
                cmds = {"default": provider_cmd() + base,
                        "off": provider_cmd() + base + ["--speculation", "off"],
                        "mlx_lm": [PYTHON, "-m", "mlx_lm", "generate", "--model", str(mlx_model),
                                   "--prompt", args.prompt, "--max-tokens", str(n)]}
                rows.append((f"generate {label}, {n} token{'s' if n > 1 else ''}", cmds))
        times: dict[str, dict[str, list[float]]] = {title: {} for title, _ in rows}
        daemon_rows = [] if args.skip_daemon else [(label, model, mlx_model) for label, model, mlx_model in models]
        daemon_times: dict[str, dict[str, list[float]]] = {label: {} for label, _, _ in daemon_rows}
        for r in range(args.rounds):
            for title, cmds in rows:
                for name in rotated(list(cmds), r):
                    times[title].setdefault(name, []).append(
                        timed(cmds[name], env, CPU.setdefault(title, {}).setdefault(name, [])))
            for label, model, mlx_model in daemon_rows:
                runs = {"provider": lambda: daemon_first_token("provider", model, env, work / "provider.log"),
                        "mlx_lm.server": lambda: daemon_first_token("mlx_lm.server", mlx_model, env,
                                                                    work / "mlx_lm_server.log"),
                        "bare mlx-lm": lambda: bare_first_token(mlx_model, env)}
                for name in rotated(list(runs), r):
                    daemon_times[label].setdefault(name, []).append(runs[name]())
            print(f"round {r + 1}/{args.rounds} done", flush=True)

        med = statistics.median
        for what, table in (("launch to exit", times), ("CPU, user + system", CPU)):
            if rows:
                print(f"\n{what}, median of {args.rounds} (s)")
                print(f"{'':34} {'default':>8} {'off':>8} {'mlx_lm':>8} {'default/mlx_lm':>15} {'off/mlx_lm':>11}")
            for title, _ in rows:
                t = {k: med(v) for k, v in table[title].items()}
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
        print(json.dumps({"generate": times, "generate_cpu": CPU, "daemon": daemon_times}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
