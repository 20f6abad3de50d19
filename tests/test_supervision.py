"""The engine is supervised: what one job raises fails that job alone; if the loop itself dies, the node says
so everywhere, fails every job at once, and the daemon exits for its service manager to restart it."""

import asyncio
import json
import shutil
import time

import httpx
import pytest

from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.registration import heartbeat
from provider.daemon import EXIT_ENGINE_FAILED
from provider.engine import sampling
from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Error
from provider.types import Cause
from provider.local.server import start_local_api
from tests.faulty_node import EngineKill, RaisingModel
from tests.helpers import LocalServer, greedy, make_node, run
from tests.helpers import collect as _collect

# A job on a dead engine is answered at once; waiting on the loop would hang until a client's 30 s timeout. The
# bound is that difference, generous for a loaded 2-core machine (it was 2 s).
FAIL_FAST_S = 10


async def collect(node, job):
    """Bounded, so that a regression (a job whose events are lost) fails here instead of hanging."""
    return await asyncio.wait_for(_collect(node, job), 60)


def _sampled(n):
    return SamplingParams(max_tokens=n, temperature=1.0)


async def _loaded(node, model_id):
    lm = node.models.request(model_id)
    return lm if hasattr(lm, "id") else await asyncio.wrap_future(lm)


def test_a_failing_forward_fails_that_job_only(fixtures_dir):
    node = make_node({"l": fixtures_dir / "llama-tiny", "q": fixtures_dir / "qwen3-tiny"})

    async def main():
        lm = await _loaded(node, "l")
        await _loaded(node, "q")
        lm.model = RaisingModel(lm.model, RuntimeError("injected forward failure"))
        bystander = asyncio.create_task(collect(node, Job("by", "q", greedy(40), prompt="The cache")))
        _, _, err, _ = await collect(node, Job("bad", "l", greedy(8), prompt="The cache is"))
        assert isinstance(err, Error) and err.cause == Cause.INTERNAL and "RuntimeError" in err.message
        _, _, done, _ = await bystander
        assert isinstance(done, Done) and done.usage.completion_tokens > 0
        for i in range(3):  # sampled jobs after a failure: MLX's random state is intact
            _, _, done, _ = await collect(node, Job(f"s{i}", "q", _sampled(4), prompt="The cache"))
            assert isinstance(done, Done), done
        assert node.healthy
        await node.stop()

    run(main())


@pytest.mark.parametrize("where", ["sampler", "logits_processors"])
def test_a_failing_sampler_or_processor_fails_that_job_only(fixtures_dir, monkeypatch, where):
    node = make_node({"q": fixtures_dir / "qwen3-tiny"})
    real = getattr(sampling, f"{where}_for" if where == "sampler" else "logits_processors_for")

    def broken(params, *limit, **kw):
        if params.seed != 666:
            return real(params, *limit, **kw)
        if where == "logits_processors":  # raises while the job starts
            raise RuntimeError("injected processor failure")

        def sample(logprobs):
            raise RuntimeError("injected sampler failure")
        return sample

    monkeypatch.setattr(sampling, "sampler_for" if where == "sampler" else "logits_processors_for", broken)

    async def main():
        bad = SamplingParams(max_tokens=4, temperature=1.0, seed=666)
        _, _, err, _ = await collect(node, Job("bad", "q", bad, prompt="x"))
        assert isinstance(err, Error) and err.cause == Cause.INTERNAL, err
        _, _, done, _ = await collect(node, Job("ok", "q", _sampled(4), prompt="x"))
        assert isinstance(done, Done)
        await node.stop()

    run(main())


def test_a_dead_engine_is_unhealthy_everywhere_and_fails_jobs_fast(fixtures_dir):
    node = make_node({"l": fixtures_dir / "llama-tiny"})
    failures = []
    node.on_engine_failure(failures.append)

    async def main():
        lm = await _loaded(node, "l")
        runner, url = await start_local_api(node, "127.0.0.1", 0, token=None)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/health")).json()["status"] == "ok"
            lm.model = RaisingModel(lm.model, EngineKill("injected"))
            r = await client.post("/v1/completions", json={"prompt": "The cache is", "max_tokens": 4})
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal", r.text
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "unhealthy"
            assert "EngineKill" in health.json()["reason"]
            started = time.monotonic()
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
            assert r.status_code == 500 and "restarting" in r.json()["error"]["message"]
            assert time.monotonic() - started < FAIL_FAST_S  # never waits on a dead loop
        # The dead loop fails its jobs first and calls back last, on its own thread, which then ends.
        await asyncio.to_thread(node.engine._thread.join, 30)
        assert failures and "EngineKill" in failures[0]
        assert heartbeat(node.status(), draining=False).status == pb.NODE_STATUS_UNHEALTHY
        started = time.monotonic()
        _, _, late, _ = await collect(node, Job("late", "l", greedy(2), prompt="x"))
        assert time.monotonic() - started < FAIL_FAST_S
        assert isinstance(late, Error) and late.cause == Cause.INTERNAL
        await node.stop()
        await runner.cleanup()

    run(main())


def test_the_daemon_exits_non_zero_when_its_engine_dies(fixtures_dir, tmp_path):
    faulty = tmp_path / "faulty-llama"
    shutil.copytree(fixtures_dir / "llama-tiny", faulty)
    srv = LocalServer(faulty, tmp_path, env={"FAULT": "kill"}, module="tests.faulty_node")
    r = httpx.post(srv.url + "/v1/completions", headers=srv.headers, timeout=60,
                   json={"prompt": "The cache is", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal", r.text
    assert srv.proc.wait(60) == EXIT_ENGINE_FAILED
    logs = srv.logs()
    assert "engine_failed" in logs and "the engine failed" in logs
    assert all(json.loads(line) for line in logs.splitlines() if line.startswith("{"))


def test_the_daemon_survives_a_forward_that_raises(fixtures_dir, tmp_path):
    faulty = tmp_path / "faulty-llama"
    shutil.copytree(fixtures_dir / "llama-tiny", faulty)
    srv = LocalServer(faulty, tmp_path, env={"FAULT": "raise"}, module="tests.faulty_node")
    try:
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/completions", headers=srv.headers, timeout=60,
                           json={"prompt": "The cache is", "max_tokens": 4})
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal", r.text
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    finally:
        assert srv.stop() == 0
