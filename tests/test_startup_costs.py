"""Start-up pays only for what it uses (issue 43): what `provider start --local` has imported once it serves and
after a plain request, the collector kept off through the imports and the first load and on (frozen) once the
model serves, and structlog without Rich. A one-shot `provider generate` likewise (issue 57): what its command
line imports before the node, and what a whole run on the bundled pair has imported at its exit."""

import json
import os
import re
import subprocess
import sys

import httpx

from tests.helpers import until_blocking

WATCHED_START = """
import gc, json, sys, threading, time
from pathlib import Path
from provider.models import loader

gate, out = Path(sys.argv.pop(1)), Path(sys.argv.pop(1))
real = loader.load_pair

def load_pair(*args, **kwargs):  # the load waits for the test's word, and says whether the collector runs meanwhile
    (out / "loading.json").write_text(json.dumps({"collecting": gc.isenabled()}))
    while not gate.exists():
        time.sleep(0.01)
    return real(*args, **kwargs)

def report():  # on the test's word (a file named ask-NAME), what this process holds now, into NAME.json
    done = set()
    while True:
        for ask in out.glob("ask-*"):
            name = ask.name[4:]
            if name not in done:
                done.add(name)
                loaded = sorted(m for m, v in list(sys.modules.items()) if v is not None)  # None: hidden, not loaded
                (out / f"{name}.json").write_text(json.dumps({
                    "collecting": gc.isenabled(), "frozen": gc.get_freeze_count(), "modules": loaded}))
        time.sleep(0.01)

loader.load_pair = load_pair
threading.Thread(target=report, daemon=True).start()
from provider.commands.cli import main
main(sys.argv[1:])
"""

# What a local start of a text model without a grammar must not import (issue 43; docs/operations.md#start-up).
# prometheus_client is imported with the node (provider/metrics.py says why).
NOT_AT_START = ("grpc", "google.protobuf", "coordinator_client", "llguidance", "mlx_vlm", "rich", "pygments")


def _held(modules: list[str], roots) -> list[str]:
    return sorted({m for m in modules for r in roots if m == r or m.startswith(r + ".")})


def _ask(out, name: str) -> dict:
    (out / f"ask-{name}").touch()
    until_blocking(lambda: (out / f"{name}.json").exists(), f"no {name} report", timeout=60)
    until_blocking(lambda: (out / f"{name}.json").read_text().endswith("}"), f"{name} report unfinished", timeout=10)
    return json.loads((out / f"{name}.json").read_text())


def test_a_local_start_imports_what_it_uses_and_collects_once_its_model_serves(fixtures_dir, tmp_path):
    gate, out = tmp_path / "go", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", WATCHED_START, str(gate), str(out), "start", "--local", "--port",
                             "0", "--no-auth", "--log-format", "json", "--model", str(fixtures_dir / "llama-tiny")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        health_url = re.search(r"health at (http://\S+)/health", proc.stdout.readline())
        assert health_url
        until_blocking(lambda: (out / "loading.json").exists(), "the load never started", timeout=60)
        assert json.loads((out / "loading.json").read_text()) == {"collecting": False}
        gate.touch()
        lines = [proc.stdout.readline() for _ in range(2)]
        assert any("/v1" in line for line in lines), lines
        serving = _ask(out, "serving")
        assert serving["collecting"] and serving["frozen"] > 0  # on again, after a freeze of what start-up loaded
        assert _held(serving["modules"], NOT_AT_START) == []
        r = httpx.post(f"{health_url[1]}/v1/chat/completions", timeout=120, json={
            "model": "llama-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        served = _ask(out, "served")
        assert _held(served["modules"], NOT_AT_START) == []  # a plain request brings nothing it did not use
        count = re.compile(r'provider:e2e_request_latency_seconds_count\{model_name="llama-tiny"\} 1\.0')
        until_blocking(lambda: count.search(httpx.get(f"{health_url[1]}/metrics", timeout=30).text),
                       "/metrics never counted the job", timeout=30)
    finally:
        proc.terminate()
        proc.wait(30)


def test_structlog_comes_without_rich_off_a_terminal_and_a_console_renderer_still_gets_its_tracebacks():
    code = ("import sys, provider.logs as logs; assert 'rich' not in sys.modules, 'rich imported'; "
            "logs.configure('info', 'console'); "
            "print(repr(logs._console_renderer().exception_formatter))")
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert ours.returncode == 0, ours.stderr
    plain = subprocess.run([sys.executable, "-c", "import structlog; "
                            "print(repr(structlog.dev.ConsoleRenderer().exception_formatter))"],
                           capture_output=True, text=True)
    assert ours.stdout == plain.stdout and "RichTracebackFormatter" in plain.stdout



def test_on_a_terminal_too_rich_comes_with_the_first_traceback_rendered():
    import pty

    code = ("import io, sys, provider.logs as logs; assert 'rich' not in sys.modules, 'rich imported'\n"
            "logs.configure('info', 'console')\nformat = logs._console_renderer().exception_formatter\n"
            "assert 'rich' not in sys.modules, 'rich imported by the renderer'\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    sio = io.StringIO(); format(sio, sys.exc_info())\n"
            "print('rich' in sys.modules, 'Traceback' in sio.getvalue() and '\u2500' in sio.getvalue())")
    leader, follower = pty.openpty()  # stderr a terminal, as `provider generate` typed at a shell has it
    try:
        r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=follower, text=True,
                           stdin=subprocess.DEVNULL, timeout=60)
    finally:
        os.close(follower)
        os.close(leader)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stdout  # Rich's box, imported to draw it

def test_json_logs_render_as_before_without_rich(tmp_path):
    code = ("import sys, provider.logs as logs\nlogs.configure('info', 'json')\nlogs.get('t').info('hello', n=1)\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    logs.get('t').exception('boom')\n"
            "assert 'rich' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    first, second = (json.loads(line) for line in r.stderr.splitlines()[:2])
    assert first["event"] == "hello" and first["n"] == 1 and first["level"] == "info"
    assert second["event"] == "boom" and "ZeroDivisionError" in second["exception"]


# Before the node: parsing the command line and probing for a daemon (none runs) import none of this; a job sent
# to a daemon pays for no model stack, and one run here for no HTTP client.
NOT_BEFORE_THE_NODE = ("aiohttp", "mlx_lm", "transformers", "numpy", "torch", "prometheus_client", "grpc",
                       "coordinator_client", "llguidance", "rich", "tools")
# A whole one-shot generation (the bundled pair, with its drafter), at its exit: no HTTP client (no daemon runs),
# no test support, nothing a local start does not import either.
NOT_IN_GENERATE = NOT_AT_START + ("aiohttp", "tools")

WATCHED_GENERATE = """
import gc, json, os, sys
from provider.commands import cli

out = sys.argv.pop(1)

def leave(code):  # the command's end: what the process holds, written before os._exit
    with open(out, "w") as f:
        json.dump({"code": code, "collecting": gc.isenabled(), "frozen": gc.get_freeze_count(),
                   "modules": sorted(m for m, v in list(sys.modules.items()) if v is not None)}, f)
    sys.stdout.flush()
    os._exit(code)

cli._leave = leave
cli.main(sys.argv[1:])
"""


def _env(tmp_path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_STATE_HOME": str(tmp_path / "state"),
            "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_generate_parses_and_looks_for_a_daemon_before_importing_the_node(tmp_path):
    code = ("import json, sys\nfrom provider.commands import cli, generate\n"
            "args = cli.build_parser().parse_args(['generate', 'Hi', '--max-tokens', '1'])\n"
            "generate._job(args)\nassert generate._find_daemon(args) is None\n"
            "print(json.dumps(sorted(m for m, v in list(sys.modules.items()) if v is not None)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert _held(json.loads(r.stdout), NOT_BEFORE_THE_NODE) == []


def test_a_one_shot_generate_imports_what_it_uses_and_collects_once_its_model_answers(tmp_path):
    out = tmp_path / "end.json"
    r = subprocess.run([sys.executable, "-c", WATCHED_GENERATE, str(out), "generate", "Hi", "--max-tokens", "2",
                        "--speculation", "off"],
                       capture_output=True, text=True, env=_env(tmp_path), timeout=300)
    end = json.loads(out.read_text())
    assert end["code"] == 0 and r.stdout.strip(), r.stderr
    assert end["collecting"] and end["frozen"] > 0  # off through the imports and the load, frozen, then on
    assert _held(end["modules"], NOT_IN_GENERATE) == []
