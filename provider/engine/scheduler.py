"""The engine loop: one thread owns MLX and advances every active job one token per pass.

Front ends hand jobs in through a thread-safe inbox and receive events through
a sink callback (called on this thread; it must not block). A job waits, in
arrival order, until its prompt is prepared off this thread. Cancels are read
between decode steps, so a cancelled job stops within one step.

Supervised: whatever one job raises fails that job alone. If the loop itself
dies, the engine is `failed`: every job, queued or new, gets a typed error at
once, and `on_failure` tells the owner, who exits for its supervisor to restart.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .. import logs
from ..jobs import Accepted, Cause, Done, Error, Event, Job, JobError, Usage
from ..models.residency import Residency
from ..prompts import Prepared
from ..telemetry import NOT_STARTED, FinishReason
from .generation import Generation

Sink = Callable[[Event], None]
log = logs.get("engine")
DRAINING_MESSAGE = "the node is draining and accepts no new jobs; retry elsewhere"
FAILED_MESSAGE = "the node's engine stopped after an internal failure ({}); the node is restarting, retry elsewhere"


@dataclass
class _Pending:
    job: Job
    sink: Sink
    arrived: float
    prepared: concurrent.futures.Future  # of Prepared: the prompt, tokenized off the engine thread


@dataclass(frozen=True)
class _Cancel:
    job_id: str


@dataclass(frozen=True)
class _Stop:
    grace_s: float  # in-flight jobs get this long to finish


_WAKE = object()  # a prompt or a model became ready: look at the queue again

# The inbox carries _Pending (a submitted job), _Cancel, _Stop and _WAKE.


@dataclass
class EngineStats:
    active: int = 0
    queued: int = 0
    jobs_completed: int = 0
    jobs_failed: int = 0
    jobs_cancelled: int = 0
    tokens_generated: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_target_forwards: int = 0


class Engine:
    def __init__(self, models: Residency, *, max_concurrent: int, max_queued: int, prefill_step_size: int):
        self.models = models
        self._max_concurrent = max_concurrent
        self._max_queued = max_queued
        self._prefill_step_size = prefill_step_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._active: dict[str, tuple[Generation, Sink]] = {}
        # Jobs whose model is loading on the loader thread; they hold no decode slot meanwhile.
        self._loading: list[tuple[_Pending, concurrent.futures.Future]] = []
        self._next_idle_check = 0.0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._draining = threading.Event()
        self._stop_at: float | None = None
        self.stats = EngineStats()
        self.last_tick = time.monotonic()  # fed to the service watchdog
        self.failure: str | None = None  # why the loop died; None while it runs
        self.on_failure: Callable[[str], None] | None = None  # called once, on the engine thread, if it dies
        self._submit_lock = threading.Lock()  # orders submits against the loop's death

    # --- called from any thread -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, sink: Sink, prepare: Callable[[Job], concurrent.futures.Future]) -> None:
        """Queue a job; `prepare(job)` starts making its prompt (a future of Prepared) off this thread."""
        with self._submit_lock:
            # Answered here too, since a stopped or dead engine thread no longer reads its inbox.
            if self.failure is not None:
                _safe(sink, Error(job.id, Cause.INTERNAL, FAILED_MESSAGE.format(self.failure)))
            elif self.draining:
                _safe(sink, Error(job.id, Cause.DRAINING, DRAINING_MESSAGE))
            else:
                prepared = prepare(job)
                self._inbox.put(_Pending(job, sink, time.perf_counter(), prepared))
                prepared.add_done_callback(lambda _: self._inbox.put(_WAKE))

    def cancel(self, job_id: str) -> None:
        self._inbox.put(_Cancel(job_id))


    def drain(self) -> None:
        """Accept no new jobs; in-flight and queued ones run to the end."""
        self._draining.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def idle(self) -> bool:
        return not self._active and not self._waiting and not self._loading

    def stop(self, grace_s: float = 10.0) -> None:
        """Drain, give in-flight jobs `grace_s` to finish, cancel the rest, and join the thread."""
        self.drain()
        self._inbox.put(_Stop(grace_s))
        self._thread.join()

    # --- engine thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the loop itself, not one job: nothing here can be trusted to go on
            self._die(f"{type(e).__name__}: {e}"[:200])

    def _die(self, why: str) -> None:
        with self._submit_lock:
            self.failure = why
        log.critical("engine_failed", error=why)
        message = FAILED_MESSAGE.format(why)
        sinks = {job_id: sink for job_id, (_, sink) in self._active.items()}
        sinks |= {p.job.id: p.sink for p in [*self._waiting, *(p for p, _ in self._loading)]}
        while True:  # jobs submitted but never read
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, _Pending):
                sinks[msg.job.id] = msg.sink
        for job_id, sink in sinks.items():
            _safe(sink, Error(job_id, Cause.INTERNAL, message))
        self._active.clear()
        self._waiting.clear()
        self._loading.clear()
        self._update_counts()
        if self.on_failure is not None:
            try:
                self.on_failure(why)
            except Exception:
                log.exception("engine_failure_callback_failed")

    def _loop(self) -> None:
        while True:
            self._pump(block=not self._active and not any(p.prepared.done() for p in self._waiting))
            if self._stop_at is not None and (time.monotonic() >= self._stop_at or self.idle):
                break
            self._admit()
            if time.monotonic() >= self._next_idle_check:
                self.models.unload_idle()
                self._next_idle_check = time.monotonic() + 1.0
            for job_id, (gen, sink) in list(self._active.items()):
                try:
                    events = gen.step()
                except Exception as e:  # a bug or MLX failure (in a forward, sampler, processor) ends this job
                    log.exception("job_step_failed", job_id=job_id)
                    _restore_random_state()
                    gen.close()
                    events = [Error(job_id, Cause.INTERNAL, f"generation failed: {type(e).__name__}")]
                self._deliver(gen.model_id, events, sink)
            self.last_tick = time.monotonic()
        for job_id in list(self._active):
            self._cancel(job_id)
        while self._waiting:
            self._cancel(self._waiting[0].job.id)
        while self._loading:
            self._cancel(self._loading[0][0].job.id)

    def _pump(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            self.last_tick = time.monotonic()
            return
        while True:
            if isinstance(msg, _Pending):
                self._enqueue(msg)
            elif isinstance(msg, _Cancel):
                self._cancel(msg.job_id)
            elif isinstance(msg, _Stop):
                self._stop_at = time.monotonic() + msg.grace_s
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._update_counts()

    def _enqueue(self, p: _Pending) -> None:
        if self.draining:
            _safe(p.sink, Error(p.job.id, Cause.DRAINING, DRAINING_MESSAGE))
        elif len(self._waiting) + len(self._loading) >= self._max_queued + max(0, self._max_concurrent - len(self._active)):
            _safe(p.sink, Error(p.job.id, Cause.OVERLOADED, f"the queue is full ({self._max_queued} jobs); retry later"))
        else:
            self._waiting.append(p)

    def _admit(self) -> None:
        for p, fut in [x for x in self._loading if x[1].done()]:
            self._loading.remove((p, fut))
            error = fut.exception()
            if error is None:
                self._waiting.appendleft(p)
            else:
                self._fail(p, error if isinstance(error, JobError) else JobError(Cause.MODEL_LOAD_FAILED, str(error)))
        # First come, first served among jobs whose prompt is ready; one still tokenizing keeps its place.
        for p in list(self._waiting):
            if len(self._active) >= self._max_concurrent:
                break
            if not p.prepared.done():
                continue
            self._waiting.remove(p)
            try:
                prepared = p.prepared.result()
                loaded = self.models.request(prepared.job.model)
            except Exception as e:
                self._fail(p, _as_job_error(e))
                continue
            if isinstance(loaded, concurrent.futures.Future):
                self._loading.append((p, loaded))
                loaded.add_done_callback(lambda _: self._inbox.put(_WAKE))
                continue
            self._start(p, prepared, loaded.id)
        self._update_counts()

    def _start(self, p: _Pending, prepared: Prepared, model_id: str) -> None:
        lm = self.models.acquire(model_id)
        try:
            gen = Generation(prepared.job, lm, list(prepared.prompt), prefill_step_size=self._prefill_step_size,
                             arrived=p.arrived, config=self.models.speculation)
        except Exception as e:
            self.models.release(model_id)
            self._fail(p, _as_job_error(e))
            return
        self._active[p.job.id] = (gen, p.sink)
        _safe(p.sink, Accepted(p.job.id, lm.id, gen.prompt_tokens))
        log.info("job_started", job_id=p.job.id, model=lm.id, prompt_tokens=gen.prompt_tokens)

    def _fail(self, p: _Pending, e: JobError) -> None:
        self.stats.jobs_failed += 1
        log.info("job_rejected", job_id=p.job.id, cause=e.cause.value)
        _safe(p.sink, Error.of(p.job.id, e))

    def _cancel(self, job_id: str) -> None:
        if job_id in self._active:
            gen, sink = self._active[job_id]
            self._deliver(gen.model_id, gen.finish(FinishReason.CANCELLED), sink)
            return
        parked = [p for p, _ in self._loading]
        for p in [*self._waiting, *parked]:
            if p.job.id == job_id:
                if p in self._waiting:
                    self._waiting.remove(p)
                    p.prepared.cancel()
                else:
                    self._loading = [x for x in self._loading if x[0] is not p]
                done = Done(job_id, FinishReason.CANCELLED, Usage(0, 0), NOT_STARTED)
                self.stats.jobs_cancelled += 1
                _safe(p.sink, done)
                break
        self._update_counts()

    def _deliver(self, model_id: str, events: list[Event], sink: Sink) -> None:
        for ev in events:
            _safe(sink, ev)
            if not isinstance(ev, (Done, Error)):
                continue
            self._active.pop(ev.job_id, None)
            self.models.release(model_id)
            if isinstance(ev, Error):
                self.stats.jobs_failed += 1
                log.info("job_finished", job_id=ev.job_id, model=model_id, cause=ev.cause.value)
            else:
                if ev.finish_reason == FinishReason.CANCELLED:
                    self.stats.jobs_cancelled += 1
                else:
                    self.stats.jobs_completed += 1
                t, spec = ev.telemetry, ev.telemetry.speculation
                self.stats.tokens_generated += ev.usage.completion_tokens
                self.stats.spec_drafted += spec.drafted
                self.stats.spec_accepted += spec.accepted
                self.stats.spec_target_forwards += spec.target_forwards
                log.info("job_finished", job_id=ev.job_id, model=model_id, finish_reason=ev.finish_reason.value,
                         completion_tokens=ev.usage.completion_tokens, ttft_ms=t.ttft_ms,
                         decode_tokens_per_s=t.decode_tokens_per_s, speculation=spec.as_dict())
            self._update_counts()

    def _update_counts(self) -> None:
        self.stats.active = len(self._active)
        self.stats.queued = len(self._waiting) + len(self._loading)


def _as_job_error(e: Exception) -> JobError:
    if isinstance(e, JobError):
        return e
    log.error("job_start_failed", error=type(e).__name__, exc_info=e)
    _restore_random_state()
    return JobError(Cause.INTERNAL, f"the job could not start: {type(e).__name__}")


def _restore_random_state() -> None:
    """A compiled sampler that raised mid-trace leaves MLX's global random state holding a placeholder,
    and every later draw from it fails; jobs sample from keys of their own, but reseed to be sure."""
    import mlx.core as mx

    mx.random.seed(secrets.randbits(63))


def _safe(sink: Sink, ev: Event) -> None:
    try:
        sink(ev)
    except Exception:  # a broken consumer must not stop the engine
        log.exception("event_sink_failed", job_id=ev.job_id)
