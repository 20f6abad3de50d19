"""Residency through the real daemon (`provider start --local` in a subprocess): a pin loaded at start and
kept, an idle timeout that unloads and gives the memory back (RSS and MLX's active memory sampled), a request's
keep_alive 0 and -1, and `provider models load|unload` against the live daemon."""

import json
import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tools.harness.daemon import LocalServer

MiB = 1 << 20


@pytest.fixture(scope="module")
def daemon(fixtures_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("residency-daemon")
    config = home / "config.toml"
    config.write_text(f"""
max_resident_models = 3
[models.heavy]
source = "{fixtures_dir / 'llama-kv-heavy'}"
idle_timeout_s = 1.5
[models.pinned]
source = "{fixtures_dir / 'qwen3-tiny'}"
pin = true
""")
    server = LocalServer(fixtures_dir / "gemma4-tiny", home, "--config", str(config))
    yield server
    server.stop()


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=30).json()


def resident(server) -> dict[str, dict]:
    return {m["id"]: m for m in health(server)["resident"]}


def wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def chat(server, model: str, **extra) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=120,
                   json={"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
                         "temperature": 0} | extra)
    assert r.status_code == 200, r.text
    return r.json()


def models_cli(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "provider", "models", *args], env=server.env, capture_output=True,
                          text=True, timeout=120)


def memory(server) -> tuple[int, int]:
    """(RSS, MLX active) of the daemon, the lower of three samples a tenth of a second apart (a sample taken
    mid-step sees that step's scratch)."""
    samples = []
    for _ in range(3):
        samples.append((psutil.Process(server.proc.pid).memory_info().rss, health(server)["memory"]["mlx_active_bytes"]))
        time.sleep(0.1)
    return min(s[0] for s in samples), min(s[1] for s in samples)


def test_a_pin_is_loaded_at_start_and_kept(daemon):
    pinned = resident(daemon)["pinned"]
    assert pinned["pinned"] and pinned["keep_alive_s"] is None and pinned["unload_at"] is None
    r = models_cli(daemon, "unload", "pinned")
    assert r.returncode == 1 and "pinned" in r.stderr
    assert "pinned" in resident(daemon)


def test_the_idle_timeout_unloads_and_gives_the_memory_back(daemon):
    wait_for(lambda: "heavy" not in resident(daemon), "heavy not loaded")
    chat(daemon, "gemma4-tiny")  # the baseline: the node as it idles, its default model warm
    rss0, active0 = memory(daemon)
    chat(daemon, "heavy")
    loaded = resident(daemon)["heavy"]
    assert loaded["keep_alive_s"] == 1.5 and loaded["unload_at"] is not None
    rss1, active1 = memory(daemon)
    assert active1 - active0 >= 8 * MiB  # its 12 MiB of weights are held
    wait_for(lambda: "heavy" not in resident(daemon), "the idle timeout to unload heavy")
    rss2, active2 = memory(daemon)
    # What the load took is given back: MLX's active memory to within 1 MiB of the baseline, the RSS to
    # within a quarter of what the load added (the rest: Python's own heaps, the tokenizer kept for prompts).
    assert active2 - active0 <= MiB, (active0, active1, active2)
    assert rss2 - rss0 <= max(0.25 * (rss1 - rss0), 4 * MiB), (rss0, rss1, rss2)


def test_keep_alive_zero_and_minus_one_through_the_api(daemon):
    chat(daemon, "heavy", keep_alive=0)
    wait_for(lambda: "heavy" not in resident(daemon), "keep_alive 0 to unload heavy after its job")
    chat(daemon, "heavy", keep_alive=-1)
    time.sleep(3)  # twice its idle timeout
    assert resident(daemon)["heavy"]["keep_alive_s"] is None
    r = httpx.post(f"{daemon.url}/v1/chat/completions", headers=daemon.headers, timeout=30,
                   json={"model": "heavy", "messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_models_load_and_unload_from_the_command_line(daemon):
    r = models_cli(daemon, "unload", "heavy")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] in ("unloaded", "not_loaded"), r.stderr
    assert "heavy" not in resident(daemon)
    r = models_cli(daemon, "load", "heavy", "--keep-alive", "10m")
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["state"] == "ready" and answer["keep_alive_s"] == 600
    assert "heavy" in resident(daemon)
    r = models_cli(daemon, "load", "no-such-model")
    assert r.returncode == 1 and "no-such-model" in r.stderr
    r = models_cli(daemon, "load", "heavy", "--keep-alive", "a while")
    assert r.returncode == 1 and "keep_alive" in r.stderr
    # The same over the TCP API needs the token; over the control socket it does not.
    r = httpx.post(f"{daemon.url}/provider/v1/models/unload", json={"model": "heavy"}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{daemon.url}/provider/v1/models/unload", json={"model": "heavy"}, headers=daemon.headers,
                   timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "unloaded"


def test_no_daemon_is_said_plainly(tmp_path):
    env = os.environ | {"XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    r = subprocess.run([sys.executable, "-m", "provider", "models", "unload", "x"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 3 and "no daemon" in r.stderr
