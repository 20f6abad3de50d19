"""The engine loop: one thread owns MLX. Each pass is, per model, one batched step over that model's jobs
(one decode forward for every decoding row and at most one prefill chunk: provider.engine.plain_batch), plus one
round of each job that speculates on its own.

Front ends hand jobs in through a thread-safe inbox and receive events through a sink callback (called on this
thread; it must not block). A job waits, in arrival order, until its prompt is prepared off this thread, its
model is resident and the batch it joins, as that batch will be with it, fits the memory budget
(Residency.admit_batch): a job that could never fit is refused with the numbers; one that must wait may be passed
over by later jobs a bounded number of times (provider.engine.waiting). A cancelled job stops within one step.

Supervised: whatever one job raises fails that job alone. If the loop itself dies, the engine is `failed`: every
job, queued or new, gets a typed error at once, and `on_failure` tells the owner, who exits to be restarted.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Callable

from .. import logs
from ..jobs import Job, JobError
from ..outputs import Accepted, Done, Error, Event, Sink, Usage
from ..types import Cause, FinishReason
from ..memory.admission import ADMIT, WAIT
from ..models.loader import LoadedModel
from ..models.residency import Residency
from ..prompts import Prepared
from ..status import EngineStats
from ..telemetry import NOT_STARTED
from .batch_bookings import BatchBookings
from .books import Books, deliver
from .inbox import WAKE, Call, Cancel, Stop
from .job_plan import job_plan
from .running import Running, restore_random_state
from .collective import collective_failure
from .waiting import Pending, Verdict, WaitingJobs

log = logs.get("engine")
DRAINING_MESSAGE = "the node is draining and accepts no new jobs; retry elsewhere"
STOPPED_MESSAGE = "the node stopped before this job started; retry elsewhere"
FAILED_MESSAGE = "the node's engine stopped after an internal failure ({}); the node is restarting, retry elsewhere"




class Engine:
    def __init__(self, models: Residency, *, max_concurrent: int, max_queued: int, step_tokens: int,
                 prefix_cache_bytes: int = 0, running: Callable[..., Running] = Running, prefix_disk=None):
        self.models = models
        self._max_concurrent = max_concurrent
        self._max_queued = max_queued
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting = WaitingJobs()
        self.stats = EngineStats()
        self._books = Books(models, self.stats)  # every job from its queueing to its one terminal event
        self._bookings = BatchBookings(lambda model_id, booked: self.models.book(model_id, booked))  # _rebook
        self._running = running(stats=self.stats, step_tokens=step_tokens, max_rows=max_concurrent,
                                prefix_cache_bytes=prefix_cache_bytes, prefix_disk=prefix_disk)
        self._next_idle_check, self._evictions_seen = 0.0, 0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._draining = threading.Event()
        self._stop_at: float | None = None
        self.last_tick = time.monotonic()  # fed to the service watchdog
        self.failure: str | None = None  # why the loop died; None while it runs
        self.on_failure: Callable[[str], None] | None = None  # called once, on the engine thread, if it dies
        self.on_job_done = self._books.on_job_done  # (done, model id), on the engine thread
        self._submit_lock = threading.Lock()  # orders submits against the loop's death

    # --- called from any thread -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, sink: Sink, prepare: Callable[[Job], concurrent.futures.Future]) -> None:
        """Queue a job; `prepare(job)` starts making its prompt (a future of Prepared) off this thread."""
        with self._submit_lock:
            # Answered here too, since a stopped or dead engine thread no longer reads its inbox.
            if self.failure is not None:
                deliver(sink, Error(job.id, Cause.INTERNAL, FAILED_MESSAGE.format(self.failure)))
            elif self.draining:
                deliver(sink, Error(job.id, Cause.DRAINING, DRAINING_MESSAGE))
            else:
                prepared = prepare(job)
                self._inbox.put(Pending(job, sink, time.perf_counter(), prepared))
                prepared.add_done_callback(lambda _: self._inbox.put(WAKE))

    def cancel(self, job_id: str) -> None:
        self._inbox.put(Cancel(job_id))

    def prefix_cache(self, model_id: str):
        """A resident model's prefix cache (engine.prefix_cache), for its thread-safe `prefetch`; or None."""
        return self._running.prefixes.get(model_id)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """`fn()` on the engine thread between steps (loads and unloads the operator asks for); its outcome."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Call(fn, result))
        return result

    def drain(self) -> None:
        """Accept no new jobs; in-flight and queued ones run to the end."""
        self._draining.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def idle(self) -> bool:
        return not len(self._books)

    def stop(self, grace_s: float = 10.0) -> None:
        """Drain, give in-flight jobs `grace_s` to finish, cancel the rest, and join the thread (again: grace ends)."""
        self.drain()
        self._inbox.put(Stop(grace_s))
        self._thread.join()

    # --- engine thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the loop itself, not one job: nothing here can be trusted to go on
            cause = Cause.GROUP_LOST if collective_failure(e) else Cause.INTERNAL
            self._die(f"{type(e).__name__}: {e}"[:200], cause)

    def abandon(self, why: str) -> None:
        """A group's watchdog found a rank stalled while this thread waits on it, maybe for ever: every job ends
        now, from the watchdog's thread, and the process exits after."""
        self._die(why, Cause.GROUP_LOST)

    def _die(self, why: str, cause: Cause = Cause.INTERNAL) -> None:
        with self._submit_lock:
            self.failure = why
        log.critical("engine_failed", error=why)
        message = FAILED_MESSAGE.format(why)
        sinks = self._books.sinks()
        while True:  # jobs submitted but never read
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, Pending):
                sinks[msg.job.id] = msg.sink
            elif isinstance(msg, Call):
                msg.result.set_exception(JobError(cause, message))
        for job_id, sink in sinks.items():
            deliver(sink, Error(job_id, cause, message))
        self._running.clear()
        self._waiting = WaitingJobs()
        self._books.clear()
        self._update_counts()
        if self.on_failure is not None:
            try:
                self.on_failure(why)
            except Exception:
                log.exception("engine_failure_callback_failed")

    def _loop(self) -> None:
        while True:
            # With nothing running, sleep until a message: a prompt or a model ready, a submit, a cancel.
            self._pump(block=not len(self._running))
            if self._stop_at is not None and (time.monotonic() >= self._stop_at or self.idle):
                break
            if self.models.evictions != self._evictions_seen:  # a load evicted a model: the prefix caches that
                self._evictions_seen = self.models.evictions  # still reach its weights go before the next admission
                self._running.keep_prefix_caches_of(set(self.models.resident()))
            self._admit()
            if time.monotonic() >= self._next_idle_check:
                unloaded = self.models.unload_idle()
                self._running.keep_prefix_caches_of(set(self.models.resident()))
                if unloaded:
                    self.models.give_back()
                self.models.check_ledger()
                self._next_idle_check = time.monotonic() + 1.0
            deliveries = self._running.step()
            self._publish_prefix_bytes()  # what the step kept for reuse is booked before any job's end is heard
            self._rebook(step=True)  # rows that read their prompts or left free their share one step late
            for events, sink in deliveries:
                self._deliver(events, sink)
            self._reconcile()
            self.last_tick = time.monotonic()
        for job_id in self._running.job_ids():  # their real outcome: cancelled, with what they generated
            self._cancel(job_id)
        for entry in self._books.entries():  # never started: the node stops, so it is the node's to refuse
            self._waiting.remove(entry.pending.job.id)
            self._books.finish(Error(entry.pending.job.id, Cause.DRAINING, STOPPED_MESSAGE))
        self._update_counts()
        self._running.close()

    def _reconcile(self) -> None:
        """A started job that no batch holds would never end: fail it, and say so (it is a bug, not a load)."""
        lost = self._books.running_ids() - set(self._running.job_ids())
        for job_id in lost:
            log.error("job_lost_by_its_batch", job_id=job_id)
            self._rebook()
            self._update_counts()
            self._books.finish(Error(job_id, Cause.INTERNAL, "the job's batch lost it; retry"))

    def _pump(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            self.last_tick = time.monotonic()
            return
        while True:
            if isinstance(msg, Pending):
                self._enqueue(msg)
            elif isinstance(msg, Cancel):
                self._cancel(msg.job_id)
            elif isinstance(msg, Stop):
                self._stop_at = time.monotonic() + msg.grace_s
            elif isinstance(msg, Call):
                self._call(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._update_counts()

    def _call(self, msg: Call) -> None:
        try:
            msg.result.set_result(msg.fn())
        except Exception as e:
            msg.result.set_exception(e)
        self._running.keep_prefix_caches_of(set(self.models.resident()))  # an unloaded model's prefixes go too
        self.models.give_back()

    def _enqueue(self, p: Pending) -> None:
        if p.job.id in self._books:  # one job id, one life: a second submit under it is refused, not merged
            deliver(p.sink, Error(p.job.id, Cause.DUPLICATE_JOB, f"job {p.job.id} is already running here"))
        elif self.draining:
            deliver(p.sink, Error(p.job.id, Cause.DRAINING, DRAINING_MESSAGE))
        elif len(self._waiting) >= self._max_queued + max(0, self._max_concurrent - len(self._running)):
            deliver(p.sink, Error(p.job.id, Cause.OVERLOADED, f"the queue is full ({self._max_queued} jobs); retry later"))
        else:
            self._books.enter(p)
            self._waiting.append(p)

    def _admit(self) -> None:
        for p, error in self._waiting.loads_ended():
            self._fail(p, error if isinstance(error, JobError) else JobError(Cause.MODEL_LOAD_FAILED, str(error)))
        self._waiting.start_in_order(self._try_start)
        self.stats.waiting_for_memory = self._waiting.waiting_for_memory
        self._update_counts()

    def _try_start(self, p: Pending) -> Verdict:
        if len(self._running) >= self._max_concurrent:
            return Verdict.FULL
        try:
            prepared = p.prepared.result()
            loaded = self.models.request(prepared.job.model)
        except Exception as e:
            self._fail(p, _as_job_error(e))
            return Verdict.GONE
        if isinstance(loaded, concurrent.futures.Future):
            self._running.trim_prefix_caches(0)  # prefix caches go before any model is evicted to make room
            self._publish_prefix_bytes()
            self._waiting.park(p, loaded)
            loaded.add_done_callback(lambda _: self._inbox.put(WAKE))
            return Verdict.GONE
        lm = self.models.acquire(loaded.id)  # held from here: nothing evicts it while the job is decided
        if lm is None:  # evicted since `request` (a load on the loader thread made room): ask for it again
            return Verdict.WAIT
        max_tokens = min(prepared.job.sampling.max_tokens, lm.context_length - len(prepared.prompt))
        if prepared.job.verify is not None:  # a claim is read to its end, within what its request allowed
            max_tokens = max(1, min(max_tokens, prepared.job.verify.length))
        # Booked for the batch it joins, as that batch will be (rows x its longest row), not for the job alone.
        # Its media (made from here) and the tower's scratch are part of that batch's layout while it is read.
        booking = self._running.booking_with(lm, len(prepared.prompt), len(prepared.prompt) + max_tokens,
                                             scored=prepared.job.sampling.prompt_logprobs or bool(prepared.job.verify),
                                             media=prepared.vision)
        admission = self.models.admit_batch(lm.id, booking)
        if admission.decision != ADMIT:
            self.models.release(lm.id)
            if admission.decision == WAIT:
                return Verdict.WAIT
            self._fail(p, JobError(Cause.INSUFFICIENT_MEMORY, admission.message(lm.id)))
            return Verdict.GONE
        self._books.started(p.job.id, lm.id)  # from here `finish` gives the model back (and _rebook its KV)
        self.models.keep(lm.id, prepared.job.keep_alive)
        self._running.trim_prefix_caches(admission.prefix_keep)
        self._publish_prefix_bytes()
        return Verdict.STARTED if self._start(p, prepared, lm, max_tokens) else Verdict.GONE

    def _publish_prefix_bytes(self) -> None:
        """The budget counts the prefix caches; only this thread touches them, so it pushes their size."""
        self.models.prefix_bytes = self._running.prefix_bytes

    def _start(self, p: Pending, prepared: Prepared, lm: LoadedModel, max_tokens: int) -> bool:
        job, prompt = prepared.job, list(prepared.prompt)
        try:
            plan = job_plan(job, lm, self.models.speculation, sharing=self._running.on_model(lm.id))
            self._running.start(job, p.sink, lm, prompt, max_tokens=max_tokens, arrived=p.arrived, plan=plan,
                                shared_prefix=prepared.shared_prefix, grammar=prepared.grammar,
                                tool_format=prepared.tool_format, vision=prepared.vision)
        except Exception as e:
            self._running.cancel(job.id)  # whatever part of it a batch took
            self._fail(p, _as_job_error(e))
            return False
        self._rebook()  # the layout it joined (plain or speculating) is known now
        deliver(p.sink, Accepted(job.id, lm.id, len(prompt)))
        log.info("job_started", job_id=job.id, model=lm.id, prompt_tokens=len(prompt), speculation=plan.reason)
        return True

    def _fail(self, p: Pending, e: JobError) -> None:
        self._waiting.remove(p.job.id)
        self._rebook()  # a job admitted but not started gives its share of the booking back
        self._update_counts()
        self._books.finish(Error.of(p.job.id, e))

    def _cancel(self, job_id: str) -> None:
        delivery = self._running.cancel(job_id)
        if delivery is not None:
            self._deliver(*delivery)
            return
        if self._waiting.remove(job_id) is not None:
            self._update_counts()
            self._books.finish(Done(job_id, FinishReason.CANCELLED, Usage(0, 0), NOT_STARTED))

    def _deliver(self, events: list[Event], sink: Sink) -> None:
        for ev in events:
            if isinstance(ev, (Done, Error)):
                self._publish_prefix_bytes()  # a cancelled speculative row keeps its KV for reuse
                self._rebook()  # its row left its batch: the batch will hold less
                self._update_counts()  # counted before the sink hears of it: the next status sees it gone
                self._books.finish(ev)
            else:
                deliver(sink, ev)

    def _rebook(self, step: bool = False) -> None:
        """Book in the residency what each model's batches will hold, from the rows they run now (batch_bookings)."""
        self._bookings.update({m: self._running.booked_bytes(m) for m in self._running.models()}, step)

    def _update_counts(self) -> None:
        self.stats.active = len(self._running)
        self.stats.queued = len(self._waiting)
        self.stats.oldest_wait_s = self._waiting.oldest_wait_s()


def _as_job_error(e: Exception) -> JobError:
    if isinstance(e, JobError):
        return e
    log.error("job_start_failed", error=type(e).__name__, exc_info=e)
    restore_random_state()
    return JobError(Cause.INTERNAL, f"the job could not start: {type(e).__name__}")
