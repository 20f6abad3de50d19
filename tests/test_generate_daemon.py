"""`provider generate` beside a running daemon: the job goes to the daemon over its control socket and prints as
if it ran in the command (text, telemetry line, --json, exit codes, Ctrl-C), with or without the daemon's TCP API.
One daemon (`start --local` on llama-tiny, llama-kv-heavy configured beside it) serves the module."""

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys

import httpx
import pytest

from provider.commands import daemon_client
from provider import status_file
from provider.startup import InstanceLock
from tests.helpers import LocalServer, until_blocking

PROMPT = "Returns the value of the attribute"


@pytest.fixture(scope="module")
def daemon(fixtures_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("gd")
    config = home / "config" / "provider" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'[models.llama-kv-heavy]\nsource = "{fixtures_dir / "llama-kv-heavy"}"\n')
    srv = LocalServer(fixtures_dir / "llama-tiny", home)
    srv.socket = home / "state" / "provider" / "control.sock"
    yield srv
    assert srv.stop() == 0, srv.logs()[-2000:]
    assert not srv.socket.exists()  # removed at stop


def _generate(env, *args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "provider", "generate", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout)


def _health(path) -> dict:
    status, body = asyncio.run(daemon_client.call("GET", "/health", socket=path))
    assert status == 200, body
    return body


def test_the_text_and_telemetry_are_the_daemon_s_own(daemon):
    api = httpx.post(daemon.url + "/v1/completions", headers=daemon.headers, timeout=60,
                     json={"model": "llama-tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0}).json()
    raw = _generate(daemon.env, PROMPT, "--raw", "--max-tokens", "20")
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout == api["choices"][0]["text"] + "\n"
    assert "20 tokens, finish length; ttft" in raw.stderr and "tok/s; speculation off (not_mtp_capable)" in raw.stderr
    assert f"llama-tiny in the daemon (pid {daemon.proc.pid}): 20 tokens" in raw.stderr, raw.stderr  # where it ran
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    api = httpx.post(daemon.url + "/v1/chat/completions", headers=daemon.headers, timeout=60,
                     json={"model": "llama-tiny", "messages": messages, "max_tokens": 12, "temperature": 0}).json()
    chat = _generate(daemon.env, "--max-tokens", "12", "--system", "Be brief.", stdin=PROMPT)
    assert chat.returncode == 0 and chat.stdout == api["choices"][0]["message"]["content"] + "\n", chat.stderr


def test_json_has_the_shape_of_a_job_run_in_the_command(daemon, fixtures_dir, tmp_path):
    forwarded = _generate(daemon.env, PROMPT, "--raw", "--max-tokens", "8", "--json")
    alone_env = daemon.env | {"XDG_STATE_HOME": str(tmp_path / "state")}  # no daemon there: runs in-process
    alone = _generate(alone_env, PROMPT, "--raw", "--max-tokens", "8", "--json", "--model",
                      str(fixtures_dir / "llama-tiny"))
    assert forwarded.returncode == 0 and alone.returncode == 0, forwarded.stderr + alone.stderr
    a, b = json.loads(forwarded.stdout), json.loads(alone.stdout)

    def shape(v):
        return {k: shape(x) for k, x in v.items()} if isinstance(v, dict) else type(v).__name__

    assert shape(a) == shape(b) and a["text"] == b["text"] and a["model"] == "llama-tiny"
    assert a["usage"]["completion_tokens"] == 8 and a["finish_reason"] == "length"


def test_refusals_exit_as_in_the_command(daemon):
    long = _generate(daemon.env, "word " * 5000, "--raw")  # the daemon's tokenizer finds it too long
    assert long.returncode == 65 and "context_length_exceeded" in long.stderr, long.stderr
    unknown = _generate(daemon.env, PROMPT, "--model", "no-such-model")
    assert unknown.returncode == 66, unknown.stderr
    assert "no-such-model" in unknown.stderr and "asked of the daemon" in unknown.stderr
    for flag in (["--drafter", "x"], ["--config", "/dev/null"]):  # settings of the node, which already runs
        r = _generate(daemon.env, PROMPT, *flag)
        assert r.returncode == 2 and flag[0] in r.stderr and "the daemon (pid" in r.stderr, r.stderr
    bad = _generate(daemon.env, PROMPT, "--temperature", "5")  # checked here, before the daemon is asked
    assert bad.returncode == 2 and "--temperature" in bad.stderr
    for lines in (long, unknown, bad):
        assert len(lines.stderr.strip().splitlines()) == 1 and lines.stderr.startswith("provider generate: ")


def test_a_model_not_resident_is_loaded_by_the_daemon(daemon):
    assert "llama-kv-heavy" not in _health(daemon.socket)["resident_models"]
    r = _generate(daemon.env, PROMPT, "--model", "llama-kv-heavy", "--max-tokens", "6", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["model"] == "llama-kv-heavy", r.stderr
    assert "llama-kv-heavy" in _health(daemon.socket)["resident_models"]


def test_ctrl_c_and_a_hang_up_cancel_the_job_in_the_daemon(daemon):
    args = [sys.executable, "-m", "provider", "generate", PROMPT, "--model", "llama-kv-heavy", "--max-tokens",
            "4000", "--temperature", "1.0", "--seed", "7"]
    before = _health(daemon.socket)["counters"]["jobs_cancelled"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=daemon.env)
    first = proc.stdout.read(20)  # text is streaming
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(first + out) > 20 and "finish cancelled" in err  # the daemon's own end of the job, its telemetry
    until_blocking(lambda: _health(daemon.socket)["counters"]["jobs_cancelled"] == before + 1, "no cancel", 30)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=daemon.env)
    proc.stdout.read(20)
    proc.kill()  # no goodbye: the daemon sees the connection close
    proc.wait()
    until_blocking(lambda: _health(daemon.socket)["counters"]["jobs_cancelled"] == before + 2, "no cancel", 30)
    assert _health(daemon.socket)["active_jobs"] == 0
    again = _generate(daemon.env, PROMPT, "--max-tokens", "4")
    assert again.returncode == 0 and "4 tokens, finish length" in again.stderr


def test_the_socket_is_the_owner_s_and_tcp_still_needs_the_token(daemon):
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600
    status, body = asyncio.run(daemon_client.call("GET", "/v1/models", socket=daemon.socket))
    assert status == 200 and [m["id"] for m in body["data"]] == ["llama-tiny", "llama-kv-heavy"]
    job = {"prompt": PROMPT, "max_tokens": 3}
    assert httpx.post(daemon.url + "/provider/v1/generate", json=job).status_code == 401
    assert httpx.get(daemon.url + "/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
    ok = httpx.post(daemon.url + "/provider/v1/generate", json=job, headers=daemon.headers, timeout=60)
    events = [json.loads(line) for line in ok.text.splitlines()]
    assert ok.status_code == 200 and ok.headers["Content-Type"].startswith("application/x-ndjson")
    assert list(events[0]) == ["accepted"] and list(events[-1]) == ["done"]
    assert all(list(e) == ["tokens"] for e in events[1:-1])
    assert events[-1]["done"]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body, param", [
    ([], "job"), ({"prompt": PROMPT, "max_tokens": 10**400}, "max_tokens"), ({"prompt": PROMPT, "top_p": "1"}, "top_p"),
    ({"prompt": PROMPT, "seed": 1.5}, "seed"), ({"prompt": PROMPT, "temperature": 1e308}, "temperature"),
    ({"prompt": PROMPT, "stream": True}, "stream"), ({"messages": [1]}, "messages"), ({"messages": "hi"}, "messages"),
    ({"prompt": PROMPT, "json_schema": {"type": "object", "foo": 1}}, "response_format"),
    ({"prompt": PROMPT, "speculation": 3}, "speculation"), ({"prompt": PROMPT, "model": ["a"]}, "model"),
    ({"prompt": "\ud800"}, "prompt"), ({"prompt": PROMPT, "schema_name": "s"}, "schema_name"),
])
def test_hostile_jobs_are_a_clear_400(daemon, body, param):
    status, answer = asyncio.run(daemon_client.call("POST", "/provider/v1/generate", body, socket=daemon.socket))
    assert status == 400 and answer["error"]["cause"] == "invalid_request" and answer["error"]["param"] == param, answer


def test_a_daemon_without_a_control_socket_is_named_and_refused(tmp_path, fixtures_dir):
    """What an older daemon looks like (the lock held, a status file, no socket; or a socket nobody serves)."""
    env = os.environ | {"XDG_STATE_HOME": str(tmp_path / "state"), "HF_HUB_OFFLINE": "1"}
    state = tmp_path / "state" / "provider"
    state.mkdir(parents=True)
    lock = InstanceLock(state)
    lock.acquire()  # this process plays the daemon
    try:
        status_file.write(state, {"pid": os.getpid()})
        r = _generate(env, PROMPT)
        assert r.returncode == 75 and "has no control socket" in r.stderr, r.stderr
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(str(state / "control.sock"))  # a file, nobody listening
        dead.close()
        r = _generate(env, PROMPT)
        assert r.returncode == 75 and "does not answer on" in r.stderr, r.stderr
    finally:
        lock.release()


def test_a_daemon_without_the_tcp_api_serves_generate_through_its_socket(fixtures_dir, tmp_path):
    env = os.environ | {"XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_STATE_HOME": str(tmp_path / "state"),
                        "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    path = tmp_path / "state" / "provider" / "control.sock"
    path.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # left behind by a daemon that was killed: the next one replaces it
    stale.close()
    # A coordinator-only node (its coordinator unreachable: it keeps dialling) has no TCP listener at all.
    proc = subprocess.Popen([sys.executable, "-m", "provider", "start", "--coordinator", "grpc://127.0.0.1:1",
                             "--model", str(fixtures_dir / "llama-tiny")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        until_blocking(lambda: proc.poll() is not None or (tmp_path / "state" / "provider" / "status.json").exists(),
                       "the daemon never served", 120)
        assert proc.poll() is None, proc.stderr.read()
        r = _generate(env, PROMPT, "--raw", "--max-tokens", "20")
        alone = _generate(env | {"XDG_STATE_HOME": str(tmp_path / "other")}, PROMPT, "--raw", "--max-tokens", "20",
                          "--model", str(fixtures_dir / "llama-tiny"))
        assert r.returncode == 0 and r.stdout == alone.stdout and "20 tokens, finish length" in r.stderr, r.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
