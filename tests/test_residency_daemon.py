"""Residency through the real daemon (`provider start --local` in a subprocess): a pin loaded at start and
kept, an idle timeout that unloads and gives the memory back (RSS and MLX's active memory sampled), a request's
keep_alive 0 and -1, `provider models load|unload` against the live daemon, a pin kept through the memory
pressure that evicts an unpinned model, the resident-model cap, and jobs racing unloads of their model
(the coordinator's WarmModel/ReleaseModel to a daemon: test_residency_daemon_coordinator.py)."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from provider.engine.prefill_plan import longest_read
from provider.memory.budget import GiB
from provider.memory.checkpoint import read_config
from provider.models.footprint import estimate_footprint
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
                          text=True, timeout=120, check=False)


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
    r = models_cli(daemon, "unload", "heavy", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] in ("unloaded", "not_loaded"), r.stderr
    assert "heavy" not in resident(daemon)
    r = models_cli(daemon, "load", "heavy", "--keep-alive", "10m", "--json")
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["state"] == "ready" and answer["keep_alive_s"] == 600
    assert "heavy" in resident(daemon)
    # Without --json, a line a person reads: the model, its state, what it holds and how long it stays.
    r = models_cli(daemon, "load", "heavy", "--keep-alive", "10m")
    assert r.returncode == 0 and r.stdout.startswith("heavy: ready, ") and " MiB, unloads" in r.stdout, r.stdout
    r = models_cli(daemon, "unload", "heavy")
    assert r.returncode == 0 and r.stdout.startswith("heavy: unloaded; ") and "MiB booked now" in r.stdout, r.stdout
    r = models_cli(daemon, "load", "heavy", "--keep-alive", "10m")
    assert r.returncode == 0 and "heavy" in resident(daemon)
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
                       text=True, timeout=60, check=False)
    assert r.returncode == 3 and "no daemon" in r.stderr


# --- memory pressure and the resident-model cap, each in a daemon of its own ------------------------------------

SMALL_BOOKS = "kv_reserve_tokens = 256\nprefill_step_size = 64\n"  # footprints as estimated below


def estimated(path) -> int:
    """A model's footprint as the daemon estimates it before loading (SMALL_BOOKS's KV and prefill read)."""
    return estimate_footprint(path, read_config(path), kv_tokens=256, prefill_step=longest_read(64)).total


def served_daemon(home, config: str) -> LocalServer:
    (home / "config.toml").write_text(config)
    return LocalServer(None, home, "--config", str(home / "config.toml"))


@pytest.fixture(scope="module")
def pressured(fixtures_dir, tmp_path_factory):
    """A budget where gemma fits beside either of the other two, never beside both (what is resident counts its
    measured bytes, below these estimates); no idle timeout and room for three by count: only memory evicts."""
    f = {n: estimated(fixtures_dir / n) for n in ("qwen3-tiny", "llama-tiny", "gemma4-tiny")}
    budget = f["gemma4-tiny"] + max(f["qwen3-tiny"], f["llama-tiny"]) + min(f["qwen3-tiny"], f["llama-tiny"]) // 4
    server = served_daemon(tmp_path_factory.mktemp("pressured"), f"""
max_resident_models = 3
memory_budget_gb = {budget / GiB!r}
{SMALL_BOOKS}
[models.pinned]
source = "{fixtures_dir / 'qwen3-tiny'}"
pin = true
[models.llama]
source = "{fixtures_dir / 'llama-tiny'}"
[models.gemma]
source = "{fixtures_dir / 'gemma4-tiny'}"
""")
    yield server
    server.stop()


def test_a_pin_survives_the_pressure_that_evicts_an_unpinned_model(pressured):
    assert sorted(resident(pressured)) == ["pinned"]  # the least recently used of all from here on
    chat(pressured, "llama")
    assert sorted(resident(pressured)) == ["llama", "pinned"]
    answer = chat(pressured, "gemma")  # no room beside both: llama goes, not the pin
    assert answer["usage"]["completion_tokens"] == 8
    now = health(pressured)
    assert sorted(now["resident_models"]) == ["gemma", "pinned"], now["resident_models"]
    assert {m["id"]: m for m in now["resident"]}["pinned"]["pinned"]
    assert now["memory"]["reserved_bytes"] <= now["memory"]["usable_bytes"]
    assert '"model": "llama", "reason": "make_room"' in pressured.logs()
    chat(pressured, "llama")  # and back: gemma is the idle unpinned one now
    assert sorted(resident(pressured)) == ["llama", "pinned"]
    assert health(pressured)["counters"]["jobs_failed"] == 0


@pytest.fixture(scope="module")
def capped(fixtures_dir, tmp_path_factory):
    """Room for every model by memory, for three by count; one of them pinned (loaded at start)."""
    server = served_daemon(tmp_path_factory.mktemp("capped"), f"""
max_resident_models = 3
memory_budget_gb = 1.0
[models.pinned]
source = "{fixtures_dir / 'qwen3-tiny'}"
pin = true
[models.a]
source = "{fixtures_dir / 'llama-tiny'}"
[models.b]
source = "{fixtures_dir / 'gemma4-tiny'}"
[models.c]
source = "{fixtures_dir / 'qwen2-tiny'}"
""")
    yield server
    server.stop()


def test_the_resident_cap_unloads_the_least_recently_used_unpinned_model(capped):
    for model in ("a", "b"):
        r = models_cli(capped, "load", model, "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["state"] == "ready", r.stderr
    chat(capped, "a")  # b is the least recently used unpinned model now (the pin, loaded first, is older)
    r = models_cli(capped, "load", "c", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "ready", r.stderr
    assert sorted(health(capped)["resident_models"]) == ["a", "c", "pinned"]
    chat(capped, "b")  # by a request as well: a is the least recently used now
    assert sorted(health(capped)["resident_models"]) == ["b", "c", "pinned"]


def test_jobs_racing_unloads_of_their_model_are_all_served(capped):
    before = health(capped)["counters"]

    def ask(i: int) -> httpx.Response:
        time.sleep(0.005 * (i % 7))  # spread over loads, jobs and unloads in flight
        if i % 2:
            return httpx.post(f"{capped.url}/provider/v1/models/unload", json={"model": "a"}, headers=capped.headers,
                              timeout=120)
        return httpx.post(f"{capped.url}/v1/chat/completions", headers=capped.headers, timeout=120,
                          json={"model": "a", "messages": [{"role": "user", "content": f"hello {i}"}],
                                "max_tokens": 8, "temperature": 0})

    answers = []
    with ThreadPoolExecutor(8) as pool:
        for _ in range(4):
            answers += list(pool.map(ask, range(16)))
    chats, unloads = answers[0::2], answers[1::2]
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers if r.status_code != 200]
    for r in chats:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and r.json()["usage"]["completion_tokens"] >= 1
    assert {r.json()["state"] for r in unloads} <= {"unloaded", "unloading", "not_loaded"}
    assert "unloaded" in {r.json()["state"] for r in unloads}  # the model did go, and came back, meanwhile
    wait_for(lambda: health(capped)["active_jobs"] == 0, "every job to end")
    after = health(capped)["counters"]
    assert after["jobs_completed"] - before["jobs_completed"] == len(chats)
    assert after["jobs_failed"] == before["jobs_failed"]
    # At rest, /health and an unload agree on whether it is resident; then a job loads it again.
    time.sleep(0.3)  # an "unloading" left behind completes once its model is idle
    held = "a" in health(capped)["resident_models"]
    r = httpx.post(f"{capped.url}/provider/v1/models/unload", json={"model": "a"}, headers=capped.headers, timeout=30)
    assert r.json()["state"] == ("unloaded" if held else "not_loaded")
    assert "a" not in health(capped)["resident_models"]
    chat(capped, "a")
    assert "a" in health(capped)["resident_models"]
