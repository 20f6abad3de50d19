"""One owner of a job's life: every admitted job gets exactly one terminal event, whatever fails around it.

Each test reproduces one way the engine used to lose a job (or itself). Failures are injected into real parts
(named as such: a wrapper that raises, or an eviction forced at the worst moment); generation is real MLX.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from provider.engine.output import JobOutput
from provider.engine.plain_batch import PlainBatch
from provider.engine.spec_rounds import Speculator
from provider.jobs import Job
from provider.outputs import Accepted, Done, Error
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
from provider.models.residency import Residency
from provider.types import Cause, FinishReason
from tests.helpers import collect, drain, first_token, greedy, make_node, run, until

TIMEOUT_S = 60


def test_a_job_queued_at_shutdown_gets_a_typed_error_and_the_local_api_no_500(fixtures_dir):
    from provider.local.server import start_local_api

    node = make_node({"q": fixtures_dir / "qwen3-tiny"}, max_concurrent_jobs=1)

    async def main():
        runner, url = await start_local_api(node, "127.0.0.1", 0, token=None)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
            long = node.run(Job("long", "q", greedy(4000), prompt="The cache"))
            await first_token(long)  # it holds the only slot: the next job queues
            queued = asyncio.create_task(client.post("/v1/completions", json={
                "model": "q", "prompt": "The cache", "max_tokens": 4, "temperature": 0}))
            await until(lambda: node.status().queued_jobs >= 1, "the request never queued")
            await node.stop(grace_s=0)
            r = await queued
            rest = await drain(long)
        await runner.cleanup()
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        # The running job's real outcome: cancelled, with what it had generated.
        assert isinstance(rest[-1], Done) and rest[-1].finish_reason == FinishReason.CANCELLED
        assert rest[-1].usage.completion_tokens >= 1

    run(main())


def test_a_model_evicted_between_ready_and_start_costs_a_reload_not_the_engine(fixtures_dir, monkeypatch):
    node = make_node({"q": fixtures_dir / "qwen3-tiny"})
    real_request = Residency.request
    evicted = []

    def request_then_evict(self, name):
        # Injected race: the model is ready when asked for, then a load on the loader thread evicts it
        # before the engine takes hold of it.
        loaded = real_request(self, name)
        if not evicted and not hasattr(loaded, "done"):
            evicted.append(name)
            with self._lock:
                self._unload_locked(loaded.id, "injected_eviction")
        return loaded

    async def main():
        await collect(node, Job("warm", "q", greedy(2), prompt="The cache"))
        monkeypatch.setattr(Residency, "request", request_then_evict)
        ids, _, end, _ = await asyncio.wait_for(collect(node, Job("a", "q", greedy(4), prompt="The cache")),
                                                TIMEOUT_S)
        assert evicted and isinstance(end, Done) and len(ids) == 4
        assert node.status().health == "ok" and node.models.loads_started == 2  # loaded again
        await node.stop()

    run(main())


def test_a_failed_speculative_round_still_ends_the_rows_it_had_finished(monkeypatch):
    node = make_node({"demo": DEMO_TARGET}, speculation="on", manager_kw={"drafters": {"demo": DEMO_ASSISTANT}})
    began = threading.Event()
    real_begin, real_round = Speculator.begin, Speculator.round

    def begin(self, rows):
        began.set()
        return real_begin(self, rows)

    def round_(self, rows):
        if began.is_set():  # injected: the round after a row began (and ended, max_tokens = 1) fails
            raise RuntimeError("injected round failure")
        return real_round(self, rows)

    async def main():
        decoding = node.run(Job("decoding", "demo", greedy(400), prompt="The cache"))
        await first_token(decoding)
        monkeypatch.setattr(Speculator, "begin", begin)
        monkeypatch.setattr(Speculator, "round", round_)
        _, _, one, _ = await asyncio.wait_for(collect(node, Job("one", "demo", greedy(1), prompt="A river")), TIMEOUT_S)
        rest = await asyncio.wait_for(drain(decoding), TIMEOUT_S)
        # Exactly one terminal event each: the row that ended in the failed step keeps its Done or gets an
        # Error, but is never left without an outcome; the row the failure hit gets an Error.
        assert isinstance(one, (Done, Error))
        assert isinstance(rest[-1], Error) and rest[-1].cause == Cause.INTERNAL
        monkeypatch.undo()
        assert isinstance((await collect(node, Job("after", "demo", greedy(3), prompt="The cache")))[2], Done)
        await until(lambda: node.engine.idle, "the engine never went idle", TIMEOUT_S)  # after its observers
        assert node.status().memory.jobs_kv_bytes == 0
        assert all(m.active_jobs == 0 for m in node.status().models)
        await node.stop()

    run(main())


def test_a_row_whose_output_fails_mid_step_fails_alone_and_loses_no_other_row(fixtures_dir, monkeypatch):
    node = make_node({"q": fixtures_dir / "qwen3-tiny"})
    gate = threading.Event()
    gate.set()
    real_step, real_token = PlainBatch.step, JobOutput.token

    def gated_step(self):
        gate.wait(TIMEOUT_S)  # held while the two jobs queue, so that they join the batch in one step
        return real_step(self)

    def token(self, t, logprob=None):
        if self.job.id == "bad":  # injected: this row's detokenizer raises
            raise KeyError(t)
        return real_token(self, t, logprob)

    async def main():
        monkeypatch.setattr(PlainBatch, "step", gated_step)
        monkeypatch.setattr(JobOutput, "token", token)
        other = node.run(Job("other", "q", greedy(200), prompt="The cache"))
        await first_token(other)
        gate.clear()
        prepared, real_prepare = [], node.prompts.prepare

        def prepare(job):  # a spy: the futures of the two prompts being made
            prepared.append(real_prepare(job))
            return prepared[-1]

        monkeypatch.setattr(node.prompts, "prepare", prepare)
        first = asyncio.create_task(collect(node, Job("first", "q", greedy(1), prompt="A river")))
        bad = asyncio.create_task(collect(node, Job("bad", "q", greedy(4), prompt="A river")))
        # Both prompts prepared and queued behind the held step.
        await until(lambda: len(prepared) == 2 and all(f.done() for f in prepared), "two prompts prepared")
        gate.set()
        (_, _, first_end, first_events), (_, _, bad_end, _) = await asyncio.wait_for(
            asyncio.gather(first, bad), TIMEOUT_S)
        assert isinstance(first_events[0], Accepted) and isinstance(first_end, Done)
        assert isinstance(bad_end, Error) and bad_end.cause == Cause.INTERNAL
        await other.aclose()  # a client that leaves: the engine ends the job on its own thread
        await until(lambda: node.engine.idle, "the engine never went idle", TIMEOUT_S)
        await node.stop()

    run(main())


def test_an_idle_engine_has_delivered_every_terminal_event_and_a_slow_observer_delays_none(fixtures_dir):
    """A job's terminal event reaches its consumer before observers (metrics) run, and the job leaves the books
    only after both: `idle` once read the books empty while a slow observer still held a dropped job's event."""
    node = make_node({"q": fixtures_dir / "qwen3-tiny"})
    order: list[tuple[str, bool]] = []
    real_submit = node.engine.submit

    def submit(job, sink, prepare):  # a spy on the engine's own sink
        def spy(ev):
            if isinstance(ev, (Done, Error)):
                order.append(("event", node.engine.idle))
            sink(ev)
        return real_submit(job, spy, prepare)

    def slow_observer(done, model_id):
        time.sleep(0.3)
        order.append(("observer", node.engine.idle))

    node.engine.on_job_done.append(slow_observer)
    node.engine.submit = submit

    async def main():
        stream = node.run(Job("left", "q", greedy(200), prompt="The cache"))
        await first_token(stream)
        await stream.aclose()  # the client leaves: nobody waits for the terminal event but the books
        await until(lambda: node.engine.idle, "the engine never went idle", TIMEOUT_S)
        assert order == [("event", False), ("observer", False)]
        await node.stop()

    run(main())
