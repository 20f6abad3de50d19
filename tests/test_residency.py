"""Models that stay or go as their owner says: keep_alive, pins, the resident cap, loads and unloads asked for,
with real fixture models and real loads in one process (the daemon's own paths: test_residency_daemon.py)."""

import asyncio

import pytest

from provider.jobs import Job, JobError
from provider.outputs import Done
from provider.memory.admission import FOREVER
from provider.types import Cause
from tests.helpers import collect, first_token, greedy, paused_models, run, until
from tests.test_models import footprints, node_for, two_of_three_budget


def resident(node) -> list[str]:
    return sorted(node.models.resident())


def test_keep_alive_zero_unloads_after_the_job_and_minus_one_keeps_past_the_idle_timeout(fixtures_dir):
    node = node_for(fixtures_dir, 1 << 30, idle_timeout=0.3)

    async def main():
        await collect(node, Job("keep", "qwen3-tiny", greedy(2), prompt="hi", keep_alive=-1))
        await collect(node, Job("go", "llama-tiny", greedy(2), prompt="hi", keep_alive="0"))
        await until(lambda: resident(node) == ["qwen3-tiny"], lambda: f"resident: {resident(node)}")
        status = node.model_status("qwen3-tiny")
        assert status.keep_alive_s is None and status.unload_at is None  # kept until someone says otherwise
        await asyncio.sleep(0.6)  # twice the node's idle timeout
        assert resident(node) == ["qwen3-tiny"]
        await collect(node, Job("later", "qwen3-tiny", greedy(2), prompt="hi", keep_alive="200ms"))
        assert node.model_status("qwen3-tiny").keep_alive_s == 0.2
        await until(lambda: not resident(node), lambda: f"resident: {resident(node)}")
        await node.stop()

    run(main())


def test_a_bad_keep_alive_is_refused_before_anything_runs(fixtures_dir):
    for bad in ("5 minutes", True, [], "nan", 1e12):
        with pytest.raises(JobError) as e:
            Job("x", "qwen3-tiny", greedy(2), prompt="hi", keep_alive=bad)
        assert e.value.cause == Cause.INVALID_REQUEST and e.value.param == "keep_alive"
    assert Job("x", "m", greedy(1), prompt="hi", keep_alive="1h30m").keep_alive == 5400
    assert Job("x", "m", greedy(1), prompt="hi", keep_alive="-5m").keep_alive == FOREVER


def test_a_pin_survives_the_pressure_that_evicts_an_unpinned_model(fixtures_dir):
    node = node_for(fixtures_dir, two_of_three_budget(fixtures_dir), pins=("gemma4-tiny",))

    async def main():
        assert node.pinned_ids() == ["gemma4-tiny"]
        await node.load_model("gemma4-tiny")
        await collect(node, Job("l", "llama-tiny", greedy(2), prompt="hi"))
        await collect(node, Job("q", "qwen3-tiny", greedy(2), prompt="hi"))  # room for it: llama goes, not the pin
        assert resident(node) == ["gemma4-tiny", "qwen3-tiny"]
        with pytest.raises(JobError, match="pinned"):
            await node.unload_model("gemma4-tiny")
        st = node.model_status("gemma4-tiny")
        assert st.pinned and st.keep_alive_s is None
        await node.stop()

    run(main())


def test_the_resident_cap_unloads_the_least_recently_used(fixtures_dir):
    node = node_for(fixtures_dir, 1 << 30, max_resident=2)

    async def main():
        for name in ("gemma4-tiny", "llama-tiny", "qwen3-tiny"):
            await node.load_model(name)
        assert resident(node) == ["llama-tiny", "qwen3-tiny"]
        await node.stop()

    run(main())


def test_load_and_unload_asked_for_and_a_job_arriving_while_its_model_unloads_is_served(fixtures_dir, monkeypatch):
    node = node_for(fixtures_dir, 1 << 30)
    paused = paused_models(monkeypatch)

    async def main():
        status = await node.load_model("llama-tiny", keep_alive="10m")
        assert status.state == "ready" and status.keep_alive_s == 600 and status.unload_at is not None
        assert await node.unload_model("llama-tiny") == "unloaded"
        assert await node.unload_model("llama-tiny") == "not_loaded"
        assert resident(node) == []
        # A job in flight holds its model: unloading waits for it, and the job ends whole.
        paused.add("llama-tiny")
        async with node.run(Job("busy", "llama-tiny", greedy(4), prompt="hi")) as stream:
            # Held by its job, not merely loaded: between the two the engine thread may take the unload first.
            await until(lambda: node.model_status("llama-tiny").active_jobs == 1, "held by its job")
            assert await node.unload_model("llama-tiny") == "unloading"
            paused.discard("llama-tiny")
            events = [ev async for ev in stream]
        assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 4
        await until(lambda: not node.models.resident(), "unloaded after its job")
        # Unloads and jobs racing: every job is served (its model loads again), none is lost.
        jobs = [collect(node, Job(f"r{i}", "llama-tiny", greedy(3), prompt="hi")) for i in range(6)]
        unloads = [node.unload_model("llama-tiny") for _ in range(6)]
        results = await asyncio.gather(*jobs, *unloads)
        assert all(isinstance(r[2], Done) for r in results[:6])
        assert set(results[6:]) <= {"unloaded", "unloading", "not_loaded"}
        await node.stop()

    run(main())


def test_an_unknown_model_or_a_load_that_cannot_fit_is_a_typed_error(fixtures_dir):
    f = footprints(fixtures_dir)
    node = node_for(fixtures_dir, min(f.values()) // 2)

    async def main():
        with pytest.raises(JobError) as e:
            await node.load_model("no-such-model")
        assert e.value.cause == Cause.UNKNOWN_MODEL
        with pytest.raises(JobError) as e:
            await node.load_model("qwen3-tiny")
        assert e.value.cause == Cause.INSUFFICIENT_MEMORY
        await node.stop()

    run(main())
