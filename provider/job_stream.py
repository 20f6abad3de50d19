"""One job's events as the front ends read them: an async iterator over what the engine delivers on its thread,
which cancels the job when it is closed early (the client gone, the coordinator lost). `Node.run` makes one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from .jobs import Job
from .outputs import TERMINAL, Event, Tokens

if TYPE_CHECKING:
    from .engine.scheduler import Engine


class JobStream:
    """Async iterator over one job's events; `aclose()` cancels the job if it is still running."""

    def __init__(self, engine: Engine, job: Job, prepare: Callable[[Job], concurrent.futures.Future]):
        self.job = job
        self._engine = engine
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._finished = False
        loop = asyncio.get_running_loop()
        engine.submit(job, lambda ev: loop.call_soon_threadsafe(self._queue.put_nowait, ev), prepare)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._finished:
            raise StopAsyncIteration
        ev = await self._queue.get()
        if isinstance(ev, TERMINAL):
            self._finished = True
        return ev

    def drain_ready(self) -> list[Event]:
        """Events already delivered, without waiting."""
        out: list[Event] = []
        while not self._finished and not self._queue.empty():
            ev = self._queue.get_nowait()
            out.append(ev)
            if isinstance(ev, TERMINAL):
                self._finished = True
        return out

    async def coalesce(self, first: Tokens, *, behind: Callable[[], bool] = lambda: False,
                       window_s: float = 0.0) -> tuple[list[Tokens], Event | None]:
        """`first` merged with the token events already waiting and, while `behind()` says the consumer's
        writer has not caught up, those arriving within `window_s`; and the non-token event that ended the
        batch, if one did. A consumer that keeps up sends every token as it comes."""
        batch = [first]
        deadline = time.monotonic() + window_s
        while True:
            for ev in self.drain_ready():
                if not isinstance(ev, Tokens):
                    return batch, ev
                batch.append(ev)
            if not behind() or time.monotonic() >= deadline:
                return batch, None
            await asyncio.sleep(0.001)

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.cancel(self.job.id)

    async def __aenter__(self) -> "JobStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
