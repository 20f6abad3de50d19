"""The jobs not yet running, and the order they start in.

First come, first served among jobs whose prompt is ready (one still tokenizing keeps its place). A job
that must wait for memory lets later jobs go first, until it has been passed over MAX_PASSED_OVER times;
then nothing behind it starts before it does. Jobs whose model is loading wait apart, holding no slot.
Engine thread only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import time
from dataclasses import dataclass
from typing import Callable

from ..jobs import Job
from ..outputs import Sink

MAX_PASSED_OVER = 8


@dataclass
class Pending:
    job: Job
    sink: Sink
    arrived: float  # perf_counter seconds
    prepared: concurrent.futures.Future  # of Prepared: the prompt, tokenized off the engine thread
    passed_over: int = 0  # later jobs started while this one waited for memory


class Verdict(enum.Enum):
    STARTED = "started"  # running now
    GONE = "gone"  # failed, or parked until its model loads: out of the line either way
    WAIT = "wait"  # its KV does not fit until running jobs finish
    FULL = "full"  # no free slot: stop looking


class WaitingJobs:
    def __init__(self):
        self._line: collections.deque[Pending] = collections.deque()
        self._loading: list[tuple[Pending, concurrent.futures.Future]] = []
        self.waiting_for_memory = 0

    def __len__(self) -> int:
        return len(self._line) + len(self._loading)

    def all(self) -> list[Pending]:
        return [*self._line, *(p for p, _ in self._loading)]

    def append(self, p: Pending) -> None:
        self._line.append(p)

    def park(self, p: Pending, load: concurrent.futures.Future) -> None:
        """Wait apart for a model load; back at the front of the line when it ends."""
        self._loading.append((p, load))

    def loads_ended(self) -> list[tuple[Pending, BaseException]]:
        """Return parked jobs whose load succeeded to the front; the ones whose load failed, with the error."""
        failed = []
        for p, fut in [x for x in self._loading if x[1].done()]:
            self._loading.remove((p, fut))
            error = fut.exception()
            if error is None:
                self._line.appendleft(p)
            else:
                failed.append((p, error))
        return failed

    def remove(self, job_id: str) -> Pending | None:
        for p in self._line:
            if p.job.id == job_id:
                self._line.remove(p)
                p.prepared.cancel()
                return p
        for p, fut in self._loading:
            if p.job.id == job_id:
                self._loading.remove((p, fut))
                return p
        return None

    def pop_any(self) -> Pending | None:
        if self._line:
            return self._line.popleft()
        return self._loading.pop(0)[0] if self._loading else None

    def start_in_order(self, try_start: Callable[[Pending], Verdict]) -> None:
        """Offer each ready job to `try_start`, in line order, under the passing-over rule."""
        blocked: Pending | None = None
        self.waiting_for_memory = 0
        for p in list(self._line):
            if not p.prepared.done():
                continue
            verdict = try_start(p)
            if verdict is Verdict.FULL:
                break
            if verdict is Verdict.WAIT:
                self.waiting_for_memory += 1
                if p.passed_over >= MAX_PASSED_OVER:
                    break  # it has waited long enough: nothing behind it goes first
                blocked = blocked or p
                continue
            if p in self._line:  # a job that failed here was already taken out when it was finished
                self._line.remove(p)
            if verdict is Verdict.STARTED and blocked is not None:
                blocked.passed_over += 1

    def oldest_wait_s(self) -> float:
        now = time.perf_counter()
        return round(max((now - p.arrived for p in self.all()), default=0.0), 3)
