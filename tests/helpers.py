"""Test helpers that drive real parts: the CLI in a subprocess, the node in-process."""

from __future__ import annotations

import asyncio
import time

from provider.engine.plain_batch import PlainBatch
from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Error, Tokens
from provider.node import Node
from tools.harness.daemon import LocalServer  # noqa: F401 (tests import it from here)
from tools.harness.nodes import make_manager, make_node  # noqa: F401 (tests import them from here)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def collect(node: Node, job: Job):
    """Run a job to its end; return (token ids, text, terminal event, all events)."""
    ids, text, events = [], [], []
    async with node.run(job) as stream:
        async for ev in stream:
            events.append(ev)
            if isinstance(ev, Tokens):
                ids.extend(ev.token_ids)
                text.append(ev.text)
    end = events[-1]
    assert isinstance(end, (Done, Error))
    return ids, "".join(text), end, events


async def first_token(stream) -> None:
    """Read a job's events up to its first Tokens (it is running)."""
    async for ev in stream:
        if isinstance(ev, Tokens):
            return


async def drain(stream) -> list:
    """The rest of a job's events."""
    return [ev async for ev in stream]


def paused_models(monkeypatch) -> set[str]:
    """The models named in the returned set decode nothing: their plain batch's step (injected over the real
    one) returns no tokens, while the engine thread goes on admitting, loading and cancelling. A job on one
    stays in flight, however fast it would decode, until the test says so."""
    paused: set[str] = set()
    real_step = PlainBatch.step
    monkeypatch.setattr(PlainBatch, "step", lambda self: [] if self.lm.id in paused else real_step(self))
    return paused


def held_models(monkeypatch) -> set[str]:
    """`paused_models` for a test that waits seconds on a clock (a job's deadline) while a model is paused: a held
    step waits 10 ms for nothing before returning no tokens, so the engine thread idles instead of spinning a
    core, and still reads its inbox (a cancel) between steps."""
    held: set[str] = set()
    real_step = PlainBatch.step

    def step(self):
        if self.lm.id not in held:
            return real_step(self)
        time.sleep(0.01)
        return []

    monkeypatch.setattr(PlainBatch, "step", step)
    return held


def run(coro):
    return asyncio.run(coro)


async def until(predicate, what="", timeout: float = 120) -> None:
    """Wait for `predicate()` to hold, polling every 10 ms, instead of sleeping and hoping it does. The deadline
    only bounds a hang; `what` (a string, or a callable for the state at the time) says what never came."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what() if callable(what) else what
        await asyncio.sleep(0.01)


def until_blocking(predicate, what="", timeout: float = 120) -> None:
    """`until` for tests outside an event loop (a daemon in a subprocess, polled over HTTP)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)
