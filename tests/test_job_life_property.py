"""Random schedules against one live node (real MLX, plain and speculating rows): submits, cancels, clients that
leave, jobs that finish, and failures injected into plain steps, speculative rounds and one job's output.
Whatever the schedule, every submitted job gets exactly one terminal event, and once the node is idle nothing
is booked, no row is left in a batch and no model is held.

The failures are injected by wrappers around the real parts (named so below); everything else is real.
"""

from __future__ import annotations

import asyncio
import collections
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provider.engine.output import JobOutput
from provider.engine.plain_batch import PlainBatch
from provider.engine.scheduler import Engine
from provider.engine.spec_rounds import Speculator
from provider.jobs import Job, SamplingParams
from provider.outputs import TERMINAL
from tests.helpers import make_node

PROMPTS = ["The cache", "A river runs", "def trim(self, n):", "Numbers: 1 2 3 4 5 6 7 8", "batch " * 30]

# Short jobs end in the same steps as others run, which is where a failing step used to lose them.
submit = st.tuples(st.just("submit"), st.integers(0, len(PROMPTS) - 1), st.sampled_from([1, 1, 2, 3, 8, 24]),
                   st.sampled_from(["on", "off"]), st.sampled_from([0.0, 0.7]))
other = st.tuples(st.sampled_from(["cancel", "drop", "fail_output"]), st.integers(0, 7))
fault = st.tuples(st.sampled_from(["fail_plain", "fail_round"]))
action = st.one_of(submit, submit, submit, other, fault, st.tuples(st.just("pause")))


class Injected:
    """Armed failures, each fired once by the wrapper of the real part it names."""

    def __init__(self):
        self.plain = threading.Event()
        self.round = threading.Event()
        self.calls = 0  # steps and rounds since a fault was armed; it fires on the third
        self.output: set[str] = set()


def _install(mp: pytest.MonkeyPatch, inj: Injected, seen: dict) -> None:
    real_submit, real_step, real_round, real_token = Engine.submit, PlainBatch.step, Speculator.round, JobOutput.token

    def submit(self, job, sink, prepare):  # every event the engine emits, whoever reads it
        def spy(ev):
            seen[ev.job_id].append(ev)
            sink(ev)
        return real_submit(self, job, spy, prepare)

    def fires(event: threading.Event) -> bool:
        if not event.is_set():
            return False
        inj.calls += 1
        if inj.calls < 3:
            return False
        event.clear()
        inj.calls = 0
        return True

    def step(self):
        out = real_step(self)  # the step runs (rows may end in it), then fails before it is handed back
        if fires(inj.plain):
            raise RuntimeError("injected plain step failure")
        return out

    def round_(self, rows):
        if fires(inj.round):
            raise RuntimeError("injected round failure")
        return real_round(self, rows)

    def token(self, t):
        if self.job.id in inj.output:
            raise KeyError("injected output failure")
        return real_token(self, t)

    mp.setattr(Engine, "submit", submit)
    mp.setattr(PlainBatch, "step", step)
    mp.setattr(Speculator, "round", round_)
    mp.setattr(JobOutput, "token", token)


async def _consume(stream, leave_after: asyncio.Event):
    async with stream:
        async for _ in stream:
            if leave_after.is_set():
                return  # the client leaves: closing the stream cancels the job


async def _run(node, schedule, inj: Injected, seen: dict, run_id: int) -> list[str]:
    ids, leaving, tasks = [], [], []
    for act in schedule:
        kind = act[0]
        if kind == "submit":
            _, p, n, spec, temp = act
            job_id = f"r{run_id}-{len(ids)}"
            job = Job(job_id, "l", SamplingParams(max_tokens=n, temperature=temp, seed=len(ids)),
                      prompt=PROMPTS[p], speculation=spec)
            ids.append(job_id)
            leaving.append(asyncio.Event())
            tasks.append(asyncio.create_task(_consume(node.run(job), leaving[-1])))
        elif kind == "pause":
            await asyncio.sleep(0.05)
        elif kind == "fail_plain":
            inj.plain.set()
        elif kind == "fail_round":
            inj.round.set()
        elif ids:
            target = ids[act[1] % len(ids)]
            if kind == "cancel":
                node.cancel(target)
            elif kind == "drop":
                leaving[ids.index(target)].set()
            else:
                inj.output.add(target)
        await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for _ in range(6000):  # the engine finishes cancelled and dropped jobs on its own thread
        if node.engine.idle:
            break
        await asyncio.sleep(0.01)
    return ids


@pytest.mark.heavy
def test_every_job_ends_exactly_once_and_an_idle_node_holds_nothing(fixtures_dir):
    node = make_node({"l": fixtures_dir / "llama-tiny"}, max_concurrent_jobs=6, prefill_step_size=16,
                     prefix_cache_gb=0.1, manager_kw={"drafters": {"l": fixtures_dir / "llama-tiny-draft"}})
    loop = asyncio.new_event_loop()
    inj, seen, runs = Injected(), collections.defaultdict(list), iter(range(10**6))
    with pytest.MonkeyPatch.context() as mp:
        try:
            _install(mp, inj, seen)
            _check(node, loop, inj, seen, runs)
        finally:
            loop.run_until_complete(node.stop())
            loop.close()


def _check(node, loop, inj, seen, runs) -> None:
    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(action, min_size=1, max_size=20))
    def check(schedule):
        inj.plain.clear(), inj.round.clear(), inj.output.clear()
        ids = loop.run_until_complete(_run(node, schedule, inj, seen, next(runs)))
        ends = {job_id: [ev for ev in seen[job_id] if isinstance(ev, TERMINAL)] for job_id in ids}
        assert all(len(e) == 1 for e in ends.values()), {k: v for k, v in ends.items() if len(v) != 1}
        status = node.status()
        assert node.engine.idle and status.active_jobs == 0 and status.queued_jobs == 0
        assert status.memory.jobs_kv_bytes == 0, status.memory
        assert all(m.active_jobs == 0 for m in status.models)
        assert not node.engine._running.job_ids() and node.engine.failure is None

    check()
