"""The coordinator session: dial out, prove identity, then serve jobs over one bidirectional stream.

JobRequests become the same `Job`s the local API makes, submitted to the same
node; their Events go back as frames, in order, with per-job sequence numbers.
A single writer task owns the stream's write side. When the stream dies,
running jobs are cancelled and reported COORDINATOR_LOST on the next session;
outcomes not yet acknowledged are sent again. Reconnects back off with full
jitter and reset only after a healthy session.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from provider import __version__, logs
from provider.jobs import Accepted, Cause, Done, Error, JobError, Tokens
from provider.node import JobStream, Node
from provider.settings import Settings

from . import convert
from .backoff import Backoff
from .channel import open_channel, plan_channel
from .identity import Identity, next_session_epoch
from .pb import provider_pb2 as pb
from .registration import heartbeat, registration

log = logs.get("coordinator")
PROTOCOL_VERSION = 1
HANDSHAKE_TIMEOUT_S = 15.0
MIN_NONCE_BYTES = 16  # a shorter challenge could be replayed or precomputed: the node does not sign it
MAX_UNACKED = 10_000
MAX_FINISHED = 10_000  # outcomes kept to answer a repeated JobRequest (ids older than that count as new)


CONNECT_METHOD = "/provider.v1.Coordinator/Connect"
_END_OF_STREAM = object()


def _lenient_frame(data: bytes) -> pb.CoordinatorFrame | None:
    """Parse a coordinator frame; None for bytes that are not one (skipped, so the session stays up)."""
    try:
        return pb.CoordinatorFrame.FromString(data)
    except DecodeError:
        return None


def _access_log(job_id: str, frame: pb.ProviderFrame, started: float | None) -> None:
    """One line per coordinator job: how it ended, how long it took, its token counts; never its text."""
    kind = frame.WhichOneof("frame")
    fields = {"job_id": job_id, "outcome": kind,
              "duration_ms": round((time.perf_counter() - started) * 1000, 3) if started else 0.0}
    if kind == "job_done":
        u = frame.job_done.usage
        fields |= {"finish_reason": frame.job_done.finish_reason, "prompt_tokens": u.prompt_tokens,
                   "completion_tokens": u.completion_tokens}
    else:
        fields["cause"] = pb.ErrorCause.Name(frame.job_error.cause)
    log.info("coordinator_job", **fields)


class SessionRejected(Exception):
    """The coordinator refused the registration."""


@dataclass
class SessionStats:
    connects: int = 0
    sessions: int = 0  # welcomed sessions
    reconnect_delays: list[float] = field(default_factory=list)
    jobs_received: int = 0
    outcomes_sent: int = 0
    outcomes_resent: int = 0
    coordinator_lost: int = 0
    garbled_frames: int = 0


class CoordinatorSession:
    def __init__(self, node: Node, settings: Settings, identity: Identity, *, url: str | None = None,
                 rand=random.random, coalesce_ms: float = 5.0):
        self.node = node
        self.settings = settings
        self.identity = identity
        self.plan = plan_channel(url or settings.coordinator, allow_insecure=settings.allow_insecure_coordinator)
        self.backoff = Backoff(settings.reconnect_base_delay_s, settings.reconnect_max_delay_s, rand)
        self.coalesce_s = coalesce_ms / 1000
        self.stats = SessionStats()
        self.session_id: str | None = None
        self.welcomed = asyncio.Event()
        self._unacked: dict[str, pb.ProviderFrame] = {}  # job outcomes not yet acknowledged, oldest first
        self._finished: dict[str, pb.ProviderFrame] = {}  # recent outcomes, acked or not: a repeat gets them again
        self._jobs: dict[str, asyncio.Task] = {}
        self._started: dict[str, float] = {}  # job id -> when it was accepted, for the access log
        self._background: set[asyncio.Task] = set()  # held so the loop does not drop them mid-flight
        self._draining = False

    # --- the reconnect loop ---------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            healthy = False
            try:
                healthy = await self._session(stop)
            except SessionRejected as e:
                log.error("coordinator_rejected", reason=str(e))
            except grpc.aio.AioRpcError as e:
                log.warning("coordinator_stream_lost", code=e.code().name)
            except (asyncio.TimeoutError, asyncio.InvalidStateError, OSError, ConnectionError) as e:
                # InvalidStateError: a write raced the stream's death.
                log.warning("coordinator_unreachable", error=type(e).__name__)
            except Exception:  # a bug in one session must not end the daemon's reconnect loop
                log.exception("coordinator_session_failed")
            if stop.is_set():
                break
            if healthy:
                self.backoff.reset()
            delay = self.backoff.next_delay()
            self.stats.reconnect_delays.append(delay)
            log.info("coordinator_reconnecting", delay_s=round(delay, 3), attempt=self.backoff.attempt)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _session(self, stop: asyncio.Event) -> bool:
        self.stats.connects += 1
        channel = open_channel(self.plan, self.settings.coordinator_ca_file)
        tasks: list[asyncio.Task] = []
        welcomed_at = None
        try:
            connect = channel.stream_stream(CONNECT_METHOD, request_serializer=pb.ProviderFrame.SerializeToString,
                                            response_deserializer=_lenient_frame)
            call = connect()
            interval = await self._handshake(call)
            welcomed_at = time.monotonic()
            outbox: asyncio.Queue[pb.ProviderFrame] = asyncio.Queue()
            for frame in self._unacked.values():  # outcomes the last coordinator may not have recorded
                self.stats.outcomes_resent += 1
                outbox.put_nowait(frame)
            tasks = [asyncio.create_task(self._writer(call, outbox), name="writer"),
                     asyncio.create_task(self._reader(call, outbox), name="reader"),
                     asyncio.create_task(self._heartbeats(outbox, interval), name="heartbeat")]
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                await self._drain_and_close(call, outbox, tasks)
            else:
                stopper.cancel()
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()
            return self._healthy(welcomed_at)
        finally:
            self.welcomed.clear()
            for t in tasks:
                t.cancel()
            await self._abandon_jobs()
            await channel.close(grace=None)
            if welcomed_at is not None:
                log.info("coordinator_session_ended", session_id=self.session_id,
                         seconds=round(time.monotonic() - welcomed_at, 3))

    def _healthy(self, welcomed_at: float | None) -> bool:
        return welcomed_at is not None and time.monotonic() - welcomed_at >= self.settings.healthy_session_s

    async def _handshake(self, call) -> float:
        first = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
        if first is grpc.aio.EOF or first is None or first.WhichOneof("frame") != "challenge":
            raise SessionRejected("the coordinator did not start with a Challenge")
        if len(first.challenge.nonce) < MIN_NONCE_BYTES:
            raise SessionRejected(f"the coordinator's nonce is {len(first.challenge.nonce)} bytes; the node signs only "
                                  f"challenges of at least {MIN_NONCE_BYTES} random bytes")
        reg = registration(self.node.status(), self.identity, nonce=first.challenge.nonce,
                           epoch=next_session_epoch(), protocol_version=PROTOCOL_VERSION,
                           software_version=__version__)
        await call.write(pb.ProviderFrame(hello=self.identity.hello(reg)))
        reply = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
        if reply is grpc.aio.EOF or reply is None:
            raise SessionRejected("the coordinator closed the stream or sent garbage during the handshake")
        if reply.WhichOneof("frame") == "reject":
            raise SessionRejected(reply.reject.reason)
        if reply.WhichOneof("frame") != "welcome":
            raise SessionRejected(f"expected Welcome, got {reply.WhichOneof('frame')}")
        self.session_id = reply.welcome.session_id
        self.stats.sessions += 1
        self.welcomed.set()
        interval = reply.welcome.heartbeat_interval_ms / 1000 or self.settings.heartbeat_interval_s
        log.info("coordinator_welcomed", session_id=self.session_id, epoch=reply.welcome.session_epoch,
                 node_id=self.identity.node_id, heartbeat_s=interval)
        return interval

    # --- the stream's two directions ------------------------------------------------

    async def _writer(self, call, outbox: asyncio.Queue) -> None:
        while True:
            frame = await outbox.get()
            if frame is _END_OF_STREAM:  # everything queued before it has been written
                await call.done_writing()
                return
            await call.write(frame)

    async def _reader(self, call, outbox: asyncio.Queue) -> None:
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                log.info("coordinator_closed_stream")
                return
            if frame is None:
                self.stats.garbled_frames += 1
                log.warning("coordinator_frame_garbled")
                continue
            kind = frame.WhichOneof("frame")
            if kind == "job_request":
                self._on_job(frame.job_request, outbox)
            elif kind == "cancel":
                if frame.cancel.job_id in self._jobs:
                    self.node.cancel(frame.cancel.job_id)
            elif kind == "job_ack":
                for job_id in frame.job_ack.job_ids:
                    self._unacked.pop(job_id, None)
            elif kind == "drain":
                self._draining = True
                task = asyncio.create_task(self._report_drained(outbox))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            elif kind == "ping":
                outbox.put_nowait(pb.ProviderFrame(pong=pb.Pong(id=frame.ping.id)))
            else:
                log.warning("coordinator_frame_ignored", kind=kind)

    async def _heartbeats(self, outbox: asyncio.Queue, interval: float) -> None:
        while True:
            outbox.put_nowait(pb.ProviderFrame(heartbeat=heartbeat(self.node.status(), draining=self._draining)))
            await asyncio.sleep(interval)

    # --- jobs -----------------------------------------------------------------------

    def _on_job(self, req: pb.JobRequest, outbox: asyncio.Queue) -> None:
        self.stats.jobs_received += 1
        # At-least-once delivery of requests: a repeat never starts a second run or sends a second, different
        # outcome under the same id. Running: nothing to do. Finished: the same outcome again.
        if req.job_id in self._jobs:
            log.info("coordinator_duplicate_job", job_id=req.job_id, state="running")
            return
        if req.job_id in self._finished:
            log.info("coordinator_duplicate_job", job_id=req.job_id, state="finished")
            outbox.put_nowait(self._finished[req.job_id])
            return
        s = self.settings
        try:
            job = convert.job_from_request(req, max_tokens_limit=s.max_tokens_limit,
                                           default_max_tokens=s.default_max_tokens)
            if self._draining or self.node.draining:
                raise JobError(Cause.DRAINING, "the node is draining and accepts no new jobs")
            if req.deadline_ms and req.deadline_ms <= time.time() * 1000:
                raise JobError(Cause.DEADLINE_EXCEEDED, "the job's deadline passed before it started")
        except JobError as e:
            self._outcome(outbox, convert.error_frame(req.job_id, e.cause, e.message), req.job_id)
            return
        self._started[job.id] = time.perf_counter()
        task = asyncio.create_task(self._serve(job.id, self.node.run(job), req.deadline_ms, outbox))
        self._jobs[job.id] = task
        task.add_done_callback(lambda _: self._jobs.pop(job.id, None))

    async def _serve(self, job_id: str, stream: JobStream, deadline_ms: int, outbox: asyncio.Queue) -> None:
        seq = 0
        timer = None
        expired = []  # set when the deadline cancelled the job: its end is then DEADLINE_EXCEEDED, not "cancelled"
        if deadline_ms:
            delay = max(0.0, deadline_ms / 1000 - time.time())
            timer = asyncio.get_running_loop().call_later(
                delay, lambda: (expired.append(True), self.node.cancel(job_id)))
        try:
            async for ev in stream:
                if isinstance(ev, Accepted):
                    outbox.put_nowait(pb.ProviderFrame(job_accepted=pb.JobAccepted(
                        job_id=job_id, model=ev.model, prompt_tokens=ev.prompt_tokens)))
                    continue
                tokens, end = (await stream.coalesce(ev, behind=lambda: not outbox.empty(), window_s=self.coalesce_s)
                               if isinstance(ev, Tokens) else ([], ev))
                if tokens:
                    outbox.put_nowait(convert.chunk_frame(job_id, seq, tokens))
                    seq += 1
                if isinstance(end, Done) and expired and end.finish_reason == "cancelled":
                    self._outcome(outbox, convert.error_frame(
                        job_id, Cause.DEADLINE_EXCEEDED, f"the job's deadline passed after "
                        f"{end.usage.completion_tokens} tokens", end.usage), job_id)
                elif isinstance(end, Done):
                    self._outcome(outbox, convert.done_frame(end), job_id)
                elif isinstance(end, Error):
                    self._outcome(outbox, convert.event_error_frame(end), job_id)
        except asyncio.CancelledError:
            # The stream died under this job: stop generating, report it on the next session.
            await stream.aclose()
            self.stats.coordinator_lost += 1
            self._outcome(None, convert.error_frame(
                job_id, Cause.COORDINATOR_LOST, "the coordinator stream died while the job ran; it was cancelled"),
                job_id)
            raise
        finally:
            if timer:
                timer.cancel()

    def _outcome(self, outbox: asyncio.Queue | None, frame: pb.ProviderFrame, job_id: str) -> None:
        """Record a job's single outcome until the coordinator acks it, and send it if a stream is up."""
        _access_log(job_id, frame, self._started.pop(job_id, None))
        if len(self._unacked) >= MAX_UNACKED:  # a coordinator that never acks must not grow us forever
            self._unacked.pop(next(iter(self._unacked)))
        self._unacked[job_id] = frame
        if len(self._finished) >= MAX_FINISHED:
            self._finished.pop(next(iter(self._finished)))
        self._finished[job_id] = frame
        self.stats.outcomes_sent += 1
        if outbox is not None:
            outbox.put_nowait(frame)

    async def _abandon_jobs(self) -> None:
        running = list(self._jobs.values())
        for t in running:
            t.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)

    async def _report_drained(self, outbox: asyncio.Queue) -> None:
        finished = len(self._jobs)
        while self._jobs:
            await asyncio.gather(*list(self._jobs.values()), return_exceptions=True)
        outbox.put_nowait(pb.ProviderFrame(drained=pb.Drained(jobs_finished=finished)))
        log.info("coordinator_drained", jobs_finished=finished)

    async def _drain_and_close(self, call, outbox: asyncio.Queue, tasks: list[asyncio.Task]) -> None:
        """Shutting down: accept nothing new, let jobs finish within the grace period, say so, close."""
        self._draining = True
        outbox.put_nowait(pb.ProviderFrame(heartbeat=heartbeat(self.node.status(), draining=True)))
        try:
            await asyncio.wait_for(self._report_drained(outbox), self.settings.shutdown_grace_s)
        except asyncio.TimeoutError:
            log.warning("coordinator_drain_timeout", jobs=len(self._jobs))
        outbox.put_nowait(_END_OF_STREAM)
        writer = tasks[0]
        try:
            await asyncio.wait_for(asyncio.shield(writer), 5)
            await asyncio.wait_for(call.code(), 5)  # the coordinator has read everything and ended the call
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            log.warning("coordinator_close_unclean")
