"""Speculation profiles kept across runs (provider.models.profile_store): measured once per pair and machine by the
real `profile.measure`, read back at the next load, measured again when their key changes, ignored (with a log
line) when corrupt or foreign, and never measured in front of a job."""

import asyncio
import json
import shutil
import threading

import pytest
from structlog.testing import capture_logs

from provider import logs, paths
from provider import speculation as sp
from provider.engine import profile
from provider.models import profile_store
from provider.jobs import Job, SamplingParams
from tests.helpers import collect, make_node, run, until


def _counting(calls: list, gate: threading.Event | None = None):
    """The node's own profiler (its measurement and its settings), through the residency's hook, counting its
    calls."""
    class Counting(profile.Profiler):
        def __call__(self, lm):
            calls.append(lm.id)
            if gate is not None:
                gate.wait(120)
            return super().__call__(lm)
    return Counting()


def _node(fixtures_dir, calls: list, gate: threading.Event | None = None):
    node = make_node({"g": fixtures_dir / "gemma4-tiny"},
                     manager_kw={"drafters": {"g": fixtures_dir / "gemma4-tiny-assistant"}})
    node.models.profiler = _counting(calls, gate)
    return node


def _model(node):
    return next(m for m in node.status().models if m.id == "g")


async def _profiled(node):
    """Load the pair and wait for its profile (read back, or measured in the background)."""
    await node.preload("g")
    await until(lambda: _model(node).speculation is not None and not _model(node).speculation_profile.get("measuring"),
                "the pair's speculation profile")
    return _model(node)


def _decisions(p: sp.SpecProfile) -> list:
    return [(c.k, c.speedup, c.acceptance, c.speedups) for c in
            (p.decide(scheme, rows) for scheme in (sp.GREEDY, sp.SPECULATIVE_SAMPLING) for rows in range(1, 9))]


def _files():
    return sorted((paths.state_dir() / profile_store.DIR_NAME).glob("*.json"))


def test_a_profile_is_measured_once_and_read_back_at_the_next_load_with_the_same_decisions(fixtures_dir):
    calls = []
    jobs = [Job("greedy", "g", SamplingParams(max_tokens=6), prompt="The cache"),
            Job("sampled", "g", SamplingParams(max_tokens=6, temperature=0.7), prompt="The cache")]

    async def load_and_decide():
        node = _node(fixtures_dir, calls)
        status = await _profiled(node)
        lm = node.models.acquire("g")
        node.models.release("g")
        decisions = _decisions(lm.spec_profile)
        telemetry = []
        for job in jobs:
            decision = (await collect(node, job))[2].telemetry.speculation.as_dict()["decision"]
            telemetry.append(decision)
        await node.stop()
        return status, decisions, telemetry

    fresh_status, fresh, fresh_jobs = run(load_and_decide())
    assert calls == ["g"] and fresh_status.speculation_profile["source"] == "measured"
    (kept,) = _files()
    assert fresh_status.speculation_profile["file"] == str(kept)

    reused_status, reused, reused_jobs = run(load_and_decide())
    assert calls == ["g"], "measured again though the kept profile holds"
    origin = reused_status.speculation_profile
    assert origin["source"] == "file" and origin["file"] == str(kept)
    assert origin["measured_at"] == fresh_status.speculation_profile["measured_at"]
    assert reused == fresh  # auto decides the same from the kept numbers as from the fresh ones
    assert [d.pop("profile")["source"] for d in fresh_jobs] == ["measured"] * 2
    assert [d.pop("profile")["source"] for d in reused_jobs] == ["file"] * 2
    assert reused_jobs == fresh_jobs
    assert {k: v for k, v in reused_status.speculation.items() if k != "profile"} == \
        {k: v for k, v in fresh_status.speculation.items() if k != "profile"}


def test_a_changed_key_measures_again_and_rewrites_the_file(fixtures_dir, monkeypatch):
    calls = []

    async def load():
        node = _node(fixtures_dir, calls)
        status = await _profiled(node)
        await node.stop()
        return status

    run(load())
    logs.configure("info", "json")  # the line says which parts of the key changed
    machine = profile_store.machine_key()
    monkeypatch.setattr(profile_store, "machine_key", lambda: machine | {"mlx_lm": machine["mlx_lm"] + "-other"})
    with capture_logs() as logged:
        status = run(load())
    assert calls == ["g", "g"] and status.speculation_profile["source"] == "measured"
    (changed,) = [e for e in logged if e["event"] == "speculation_profile_key_changed"]
    assert changed["changed"] == ["mlx_lm"]
    (kept,) = _files()  # the same pair of weights: one file, rewritten under the new key
    assert json.loads(kept.read_text())["key"]["mlx_lm"] == machine["mlx_lm"] + "-other"
    run(load())
    assert calls == ["g", "g"]  # and read back under it


def test_other_weights_are_another_key(fixtures_dir, tmp_path):
    """The key holds the manifest hashes: a changed file in the drafter's checkpoint is another pair."""
    copy = shutil.copytree(fixtures_dir / "gemma4-tiny-assistant", tmp_path / "assistant")
    before = profile_store.pair_key(profile_store.weights_hash(fixtures_dir / "gemma4-tiny"),
                                    profile_store.weights_hash(copy), "mtp", profile.SETTINGS)
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    after = profile_store.pair_key(profile_store.weights_hash(fixtures_dir / "gemma4-tiny"),
                                   profile_store.weights_hash(copy), "mtp", profile.SETTINGS)
    assert before["target"] == after["target"] and before["drafter"] != after["drafter"]


def test_a_corrupt_file_is_ignored_with_a_log_line_and_measured_again(fixtures_dir):
    calls = []

    async def load():
        node = _node(fixtures_dir, calls)
        status = await _profiled(node)
        await node.stop()
        return status

    run(load())
    (kept,) = _files()
    kept.write_bytes(kept.read_bytes()[:-40])  # cut short, as by a full disk
    with capture_logs() as logged:
        status = run(load())
    assert calls == ["g", "g"] and status.speculation_profile["source"] == "measured"
    (ignored,) = [e for e in logged if e["event"] == "speculation_profile_ignored"]
    assert ignored["file"] == str(kept) and "not JSON" in ignored["why"]
    assert profile_store.read(kept.parent, json.loads(kept.read_text())["key"]).profile is not None  # rewritten


def _good_body(key: dict) -> dict:
    costs = sp.SpecCosts(0.010, (0.012, 0.016), rows=4, plain_rows_s=0.040, round_rows_s=(0.080, 0.112))
    directory = paths.state_dir() / "probe"
    body = json.loads(profile_store.write(directory, key, sp.SpecProfile(costs, {sp.GREEDY: 0.5,
                                                                                 sp.SPECULATIVE_SAMPLING: 0.4}),
                                          1_700_000_000.0).read_text())
    shutil.rmtree(directory)
    return body


@pytest.mark.parametrize("spoil", [
    "pickle", "not_an_object", "extra_field", "other_format", "nan_time", "negative_cost", "acceptance_above_one",
    "rows_float", "too_many_ks", "lengths_differ", "too_large", "missing_scheme"])
def test_a_foreign_file_is_ignored_with_a_log_line(spoil):
    key = {"format": 1, "target": "t" * 64, "drafter": "d" * 64, "drafter_mode": "mtp", "mlx": "x"}
    body = _good_body(key)
    spoiled = {
        "pickle": lambda: b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94.",
        "not_an_object": lambda: [1, 2, 3],
        "extra_field": lambda: body | {"code": "__import__('os')"},
        "other_format": lambda: body | {"format": 2},
        "nan_time": lambda: body | {"measured_at": float("nan")},
        "negative_cost": lambda: body | {"costs": body["costs"] | {"plain_token_s": -1.0}},
        "acceptance_above_one": lambda: body | {"acceptance": body["acceptance"] | {"greedy": 1.5}},
        "rows_float": lambda: body | {"costs": body["costs"] | {"rows": 4.0}},
        "too_many_ks": lambda: body | {"costs": body["costs"] | {"round_s": [0.01] * 17}},
        "lengths_differ": lambda: body | {"costs": body["costs"] | {"round_rows_s": [0.08]}},
        "too_large": lambda: body | {"key": key | {"padding": "x" * (profile_store.MAX_BYTES + 1)}},
        "missing_scheme": lambda: body | {"acceptance": {"greedy": 0.5}},
    }[spoil]()
    directory = paths.state_dir() / profile_store.DIR_NAME
    directory.mkdir(parents=True)
    path = profile_store.file_for(directory, key)
    path.write_bytes(spoiled if isinstance(spoiled, bytes) else json.dumps(spoiled).encode())
    with capture_logs() as logged:
        found = profile_store.read(directory, key, now=1_700_000_100.0)
    assert found.profile is None and found.why.startswith("ignored")
    assert [e["event"] for e in logged] == ["speculation_profile_ignored"]
    path.write_text(json.dumps(body))  # the same file unspoiled is read
    assert profile_store.read(directory, key, now=1_700_000_100.0).profile.costs.round_s == (0.012, 0.016)


def test_a_stale_profile_is_served_until_measured_again():
    key = {"format": 1, "target": "t", "drafter": "d", "drafter_mode": "mtp"}
    body = _good_body(key)
    directory = paths.state_dir() / profile_store.DIR_NAME
    directory.mkdir(parents=True)
    profile_store.file_for(directory, key).write_text(json.dumps(body))
    fresh = profile_store.read(directory, key, now=body["measured_at"] + 60)
    stale = profile_store.read(directory, key, now=body["measured_at"] + profile_store.MAX_AGE_S + 60)
    future = profile_store.read(directory, key, now=body["measured_at"] - 3600)  # a clock set back
    assert not fresh.stale and stale.stale and future.stale
    assert stale.profile.costs == fresh.profile.costs


def test_no_job_waits_for_a_measurement(fixtures_dir):
    """The first load on a machine serves at once: a job under auto decodes plain (profile_pending) while the
    measurement is held back, and finishes; auto speculates by the costs once they are in."""
    calls, gate = [], threading.Event()
    node = _node(fixtures_dir, calls, gate)

    async def main():
        done = (await asyncio.wait_for(collect(node, Job("first", "g", SamplingParams(max_tokens=6),
                                                         prompt="The cache")), 120))[2]
        pending = _model(node).speculation_profile
        gate.set()
        status = await _profiled(node)
        after = (await collect(node, Job("after", "g", SamplingParams(max_tokens=6), prompt="The cache")))[2]
        await node.stop()
        return done, pending, status, after

    done, pending, status, after = run(main())
    spec = done.telemetry.speculation.as_dict()
    assert spec == {"mode": "off", "reason": "profile_pending"} and done.usage.completion_tokens == 6
    assert pending["source"] == "measuring" and calls == ["g"]
    assert status.speculation_profile["source"] == "measured"
    assert after.telemetry.speculation.as_dict()["reason"] in ("ok", "not_profitable")


def test_a_node_stopped_while_it_measures_ends_the_measurement_and_keeps_nothing(fixtures_dir):
    """A daemon's stop (Ctrl-C seconds after its start) does not wait for the measurement: the real one, held at its
    start until the node stops, ends at its first step with a log line, no file and no profile; a stop that asks to
    finish it (a one-shot `provider generate`) keeps it."""
    logs.configure("info", "json")  # the stop's line is an info one
    started = threading.Event()

    class HeldUntilTheNodeStops(profile.Profiler):
        def __call__(self, lm):
            started.set()
            self._stopping.wait(120)
            return super().__call__(lm)

    async def stopped_while_measuring():
        node = _node(fixtures_dir, [])
        node.models.profiler = HeldUntilTheNodeStops()
        await node.preload("g")
        await until(started.is_set, "the measurement never started")
        with capture_logs() as logged:
            await asyncio.wait_for(node.stop(), 60)
        return node, logged

    node, logged = run(stopped_while_measuring())
    assert [e["model"] for e in logged if e["event"] == "speculation_profile_stopped"] == ["g"]
    assert not any(e["event"] in ("speculation_profile_measured", "speculation_profile_failed") for e in logged)
    assert _files() == [] and node.models._profiles.measured == 0

    calls = []
    node = _node(fixtures_dir, calls, gate := threading.Event())

    async def finished_at_stop():
        await node.preload("g")
        await until(lambda: calls == ["g"], "the measurement never started")
        gate.set()  # it goes on while the node stops
        await node.stop(finish_measuring=True)

    run(finished_at_stop())
    assert len(_files()) == 1 and node.models._profiles.measured == 1


GATED_START = """
import sys, time
from pathlib import Path
from provider.models import loader

gate, real = Path(sys.argv.pop(1)), loader.load_pair

def load_pair(*args, **kwargs):  # the load waits for the test's word: 'loading' is then certain, not a race
    while not gate.exists():
        time.sleep(0.01)
    return real(*args, **kwargs)

loader.load_pair = load_pair
from provider.commands.cli import main
main(sys.argv[1:])
"""


def test_the_daemon_listens_while_its_model_loads_and_health_says_loading(fixtures_dir, tmp_path):
    import re
    import subprocess
    import sys

    import httpx

    from tests.helpers import until_blocking

    gate = tmp_path / "go"
    env = {**__import__("os").environ, "XDG_STATE_HOME": str(tmp_path / "state"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", GATED_START, str(gate), "start", "--local", "--port", "0",
                             "--no-auth", "--log-format", "json", "--model", str(fixtures_dir / "llama-tiny")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        first = proc.stdout.readline()
        health_url = re.search(r"health at (http://\S+/health)", first)
        assert health_url, first
        loading = httpx.get(health_url[1], timeout=30)
        assert loading.status_code == 200 and loading.json()["status"] == "loading"
        assert loading.json()["resident_models"] == []
        gate.touch()
        lines = [proc.stdout.readline() for _ in range(2)]
        assert any("/v1" in line for line in lines), lines
        until_blocking(lambda: httpx.get(health_url[1], timeout=30).json()["status"] == "ok", "health never said ok")
        assert httpx.get(health_url[1]).json()["resident_models"] == ["llama-tiny"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_jobs_served_while_the_pair_is_measured_decode_exactly_as_plain(fixtures_dir):
    """The measurement runs beside the pair's serving (MLX from two threads on the same weights): jobs in that
    time decode plain and give the plain tokens, and so do the ones that speculate once the costs are in."""
    calls, started, gate = [], threading.Event(), threading.Event()
    node = _node(fixtures_dir, calls)

    def measuring_until_told(lm):  # the real measurement, repeated until the jobs are done: they overlap it
        started.set()
        result = profile.measure(lm)
        while not gate.is_set():
            result = profile.measure(lm)
        return result

    node.models.profiler = measuring_until_told
    job = lambda name, policy="auto": Job(name, "g", SamplingParams(max_tokens=12, temperature=0.0),  # noqa: E731
                                          prompt="The cache", speculation=policy)

    async def main():
        await node.preload("g")
        await until(started.is_set, "the measurement never started")
        during = [await collect(node, job(f"during{i}")) for i in range(3)]
        plain = await collect(node, job("plain", "off"))
        measuring = _model(node).speculation_profile
        gate.set()
        await _profiled(node)
        after = await collect(node, job("after", "on"))
        await node.stop()
        return during, plain, measuring, after

    during, plain, measuring, after = run(main())
    assert measuring["source"] == "measuring"
    for ids, _, done, _ in during:
        assert done.telemetry.speculation.reason == "profile_pending" and ids == plain[0]
    assert after[2].telemetry.speculation.mode.value == "mtp" and after[0] == plain[0]
