"""The engine's books: every job the engine has taken, from the moment it is queued until its one terminal
event, and the one `finish` that ends it.

The engine thread is the only writer. A job is entered when it joins the queue; it holds its model (a
refcount in the residency) from the moment it starts, and its batch's KV is booked by the engine; `finish` releases the model, counts
the job, and delivers the terminal event, exactly once: a second `finish` of the same job is dropped
(and logged), so a job can never get two outcomes, and a job that is still in the books at idle is a bug the
engine catches (`Engine._reconcile`), not a hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import logs
from ..outputs import Done, Error, Event, Sink
from ..models.residency import Residency
from ..status import EngineStats
from ..types import FinishReason
from .waiting import Pending

log = logs.get("engine")


@dataclass
class Entry:
    pending: Pending
    model_id: str | None = None  # set once the job holds its model (a refcount)
    ending: bool = False  # inside `finish`: the job stays in the books (the engine is not idle) until it returns

    @property
    def started(self) -> bool:
        return self.model_id is not None


class Books:
    def __init__(self, models: Residency, stats: EngineStats):
        self.models = models
        self.stats = stats
        self._jobs: dict[str, Entry] = {}
        self.on_job_done: list[Callable[[Done, str], None]] = []  # (done, model id), on the engine thread

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def enter(self, p: Pending) -> None:
        self._jobs[p.job.id] = Entry(p)

    def started(self, job_id: str, model_id: str) -> None:
        """The job holds `model_id` now (its batch's KV is booked by the engine): `finish` gives it back."""
        self._jobs[job_id].model_id = model_id

    def running_ids(self) -> set[str]:
        return {job_id for job_id, e in self._jobs.items() if e.started}

    def sinks(self) -> dict[str, Sink]:
        return {job_id: e.pending.sink for job_id, e in self._jobs.items()}

    def entries(self) -> list[Entry]:
        return list(self._jobs.values())

    def clear(self) -> None:
        """Forget every job (the engine died and answered each of them itself)."""
        self._jobs.clear()

    def finish(self, ev: Event) -> bool:
        """End a job with its terminal event (Done or Error): free what it holds, count it, deliver the event,
        then tell the observers. The job leaves the books last, so an engine that reads idle has delivered
        every terminal event. False, and nothing delivered, if the job already ended."""
        entry = self._jobs.get(ev.job_id)
        if entry is None or entry.ending:
            log.error("second_terminal_event_dropped", job_id=ev.job_id, event=type(ev).__name__)
            return False
        entry.ending = True
        try:
            if entry.model_id is not None:
                self.models.release(entry.model_id)
            self._count(ev)
            deliver(entry.pending.sink, ev)
            self._observe(ev, entry.model_id)
        finally:
            del self._jobs[ev.job_id]
        return True

    def _count(self, ev: Event) -> None:
        if isinstance(ev, Error):
            self.stats.jobs_failed += 1
            return
        assert isinstance(ev, Done)
        if ev.finish_reason == FinishReason.CANCELLED:
            self.stats.jobs_cancelled += 1
        else:
            self.stats.jobs_completed += 1
        spec = ev.telemetry.speculation
        self.stats.tokens_generated += ev.usage.completion_tokens
        self.stats.prompt_tokens += ev.usage.prompt_tokens
        self.stats.spec_drafted += spec.drafted
        self.stats.spec_accepted += spec.accepted
        self.stats.spec_target_forwards += spec.target_forwards
        if ev.proof is not None:
            self.stats.proofs_made += 1
        if ev.verdict is not None:
            self.stats.verify_jobs += 1
            self.stats.verify_passed += int(ev.verdict.passed)

    def _observe(self, ev: Event, model_id: str | None) -> None:
        """Observers (metrics) and the log line, after the job's own consumer has its event."""
        if isinstance(ev, Error):
            log.info("job_finished", job_id=ev.job_id, model=model_id, cause=ev.cause.value)
            return
        for observer in self.on_job_done:
            try:
                observer(ev, model_id or "")
            except Exception:
                log.exception("job_observer_failed", job_id=ev.job_id)
        t, spec = ev.telemetry, ev.telemetry.speculation
        log.info("job_finished", job_id=ev.job_id, model=model_id, finish_reason=ev.finish_reason.value,
                 completion_tokens=ev.usage.completion_tokens, cached_prompt_tokens=t.cached_prompt_tokens,
                 ttft_ms=t.ttft_ms, decode_tokens_per_s=t.decode_tokens_per_s, speculation=spec.as_dict())


def deliver(sink: Sink, ev: Event) -> None:
    try:
        sink(ev)
    except Exception:  # a broken consumer must not stop the engine
        log.exception("event_sink_failed", job_id=ev.job_id)
