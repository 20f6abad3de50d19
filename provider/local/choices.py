"""The jobs of one HTTP request (a job per choice: prompts x n), started and read as one stream.

Each prompt's first choice starts first and keeps its prompt's KV once read (`Job.share_prompt`); its other
n-1 choices start when it has read the prompt (its first event after Accepted), so they take the prompt from
the prefix cache instead of reading it again: one prefill per prompt. A choice refused at the start fails the
whole request with its error; the rest are cancelled as the request's stack closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..outputs import Accepted, Error, Event, TERMINAL, Tokens
from ..job_stream import JobStream
from ..node import Node
from ..types import Cause
from . import openai_api as api


@dataclass
class Choice:
    index: int
    stream: JobStream
    early: list[Event] = field(default_factory=list)  # read while waiting for its prompt to be read

    async def next(self) -> Event:
        return self.early.pop(0) if self.early else await anext(self.stream)


async def open_choices(node: Node, req: api.ParsedRequest, stack: contextlib.AsyncExitStack) -> tuple[str, list[Choice]]:
    """Start every job of the request; the served model's id and the choices, by index."""
    n = req.n
    started = [await _start(node, req.jobs[i], i, stack) for i in range(0, len(req.jobs), n)]
    model = started[0][0]
    choices: list[Choice] = []
    for (_, first), p in zip(started, range(0, len(req.jobs), n)):
        choices.append(first)
        if n > 1:
            first.early.append(await anext(first.stream))  # the prompt is read (or the job ended): it is cached
            choices += [(await _start(node, req.jobs[i], i, stack))[1] for i in range(p + 1, p + n)]
    return model, choices


async def _start(node: Node, job, index: int, stack: contextlib.AsyncExitStack) -> tuple[str, Choice]:
    stream = await stack.enter_async_context(node.run(job))
    first = await anext(stream)
    if isinstance(first, Error):
        raise api.error_for(first.cause, first.message, first.param)
    if not isinstance(first, Accepted):  # ended before it started: only a cancel does that
        raise api.error_for(Cause.DRAINING, "the job was cancelled before it started; retry")
    return first.model, Choice(index, stream)


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, list[Tokens], Event | None]]:
    """Every choice's events as they come: (choice, token events coalesced, the event that ended the batch)."""
    pending = {asyncio.ensure_future(c.next()): c for c in choices}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f].index):
                choice = pending.pop(fut)
                ev = fut.result()
                if not isinstance(ev, Tokens):
                    batch, end = [], ev
                else:  # what was read early is not the stream's to coalesce past
                    batch, end = ([ev], None) if choice.early else await choice.stream.coalesce(ev)
                yield choice, batch, end
                if not isinstance(end, TERMINAL):
                    pending[asyncio.ensure_future(choice.next())] = choice
    finally:
        for fut in pending:
            fut.cancel()
