"""The coordinator session: dial out, prove identity, then serve jobs over one bidirectional stream.

This module owns the stream: the handshake, the single writer task, the reader that dispatches frames,
heartbeats, drains and reconnects (full jitter backoff, reset only after a healthy session). What happens
to a job, from JobRequest to its one outcome, is `serving.CoordinatorJobs`. When the stream dies, running
jobs are cancelled and reported COORDINATOR_LOST on the next session; unacknowledged outcomes are sent again.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from provider import __version__, logs
from provider.node import Node
from provider.settings import Settings

from .backoff import MAX_RETRY_AFTER_S, Backoff, reconnect_delay
from .channel import open_channel, plan_channel
from .convert import MAX_JOB_ID, valid_job_id
from .identity import Identity, next_session_epoch
from .outbox import CoordinatorNotReading, Outbox
from .pb import provider_pb2 as pb
from .registration import heartbeat, registration
from .residency import ResidencyFrames
from .sealing import SealingKey
from .serving import CoordinatorJobs
from .spot_check_verdicts import SpotCheckVerdicts

log = logs.get("coordinator")
PROTOCOL_VERSION = 1
HANDSHAKE_TIMEOUT_S = 15.0
MIN_NONCE_BYTES = 16  # a shorter challenge could be replayed or precomputed: the node does not sign it
# The heartbeat interval a Welcome may set, as the node's own setting allows: each heartbeat builds a whole
# status on the event loop, so 1 ms would be a thousand of them a second.
HEARTBEAT_RANGE_S = (0.1, 300.0)
HANDSHAKE_FRAMES = ("challenge", "welcome", "reject")  # out of order once the session is up

CONNECT_METHOD = "/provider.v1.Coordinator/Connect"
_END_OF_STREAM = object()


@dataclass(frozen=True)
class Garbled:
    """Bytes from the coordinator that are not a CoordinatorFrame."""

    size: int
    error: str


def _lenient_frame(data: bytes) -> pb.CoordinatorFrame | Garbled:
    """Parse a coordinator frame; bytes that are not one are answered with ProtocolError, and the session stays up."""
    try:
        return pb.CoordinatorFrame.FromString(data)
    except DecodeError as e:
        return Garbled(len(data), str(e) or "not a CoordinatorFrame")


class SessionRejected(Exception):
    """The coordinator refused the registration (or the handshake went wrong)."""

    def __init__(self, reason: str, *, retry_after_s: float = 0.0, permanent: bool = False):
        super().__init__(reason)
        self.retry_after_s = retry_after_s
        self.permanent = permanent


@dataclass
class SessionStats:
    connects: int = 0
    sessions: int = 0  # welcomed sessions
    reconnect_delays: list[float] = field(default_factory=list)
    outcomes_resent: int = 0
    garbled_frames: int = 0
    protocol_errors: int = 0  # ProtocolError frames sent
    not_reading: int = 0  # sessions ended because the coordinator left the outbox over its limit


class CoordinatorSession:
    def __init__(self, node: Node, settings: Settings, identity: Identity, *, url: str | None = None,
                 rand=random.random, coalesce_ms: float = 5.0, sealing: SealingKey | None = None):
        self.node = node
        self.settings = settings
        self.identity = identity
        self.sealing = sealing or SealingKey()  # this process's only: never written anywhere
        self.plan = plan_channel(url or settings.coordinator, allow_insecure=settings.allow_insecure_coordinator)
        self.backoff = Backoff(settings.reconnect_base_delay_s, settings.reconnect_max_delay_s, rand)
        self.stats = SessionStats()
        self.session_id: str | None = None
        self.coordinator_version = ""
        self.rejected: str | None = None  # set when a Reject said retrying cannot succeed; the node stops dialing
        self.welcomed = asyncio.Event()
        self.connected_since: float | None = None  # unix time of the current session's Welcome; None between them
        self.throttle = logs.Throttle()  # for the lines a coordinator can make the node repeat
        self.jobs = CoordinatorJobs(node, settings, identity, self.sealing, coalesce_s=coalesce_ms / 1000,
                                    throttle=self.throttle)
        # The one pending drain report: a Drain while it waits joins it, so a flood of Drain frames holds one
        # task, not one each (60,000 of them held 124 MiB outside the outbox's bound).
        self._drain_report: asyncio.Task | None = None
        self.residency = ResidencyFrames(node)
        self.verdicts = SpotCheckVerdicts()  # what the coordinator told of its spot checks on this node's jobs

    # --- the reconnect loop ---------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            healthy, retry_after = False, 0.0
            try:
                healthy = await self._session(stop)
            except SessionRejected as e:
                log.error("coordinator_rejected", reason=str(e), permanent=e.permanent, retry_after_s=e.retry_after_s,
                          capped=e.retry_after_s > MAX_RETRY_AFTER_S)
                if e.permanent:
                    self.rejected = str(e)
                    return
                retry_after = e.retry_after_s
            except CoordinatorNotReading as e:
                self.stats.not_reading += 1
                log.warning("coordinator_not_reading", reason=str(e))
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
            delay = reconnect_delay(self.backoff.next_delay(), retry_after)
            self.stats.reconnect_delays.append(delay)
            log.info("coordinator_reconnecting", delay_s=round(delay, 3), attempt=self.backoff.attempt)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _session(self, stop: asyncio.Event) -> bool:
        self.stats.connects += 1
        await asyncio.to_thread(self.node.hash_models)  # before dialing: the hashes go in the registration
        channel = open_channel(self.plan, self.settings.coordinator_ca_file)
        tasks: list[asyncio.Task] = []
        welcomed_at = None
        try:
            connect = channel.stream_stream(CONNECT_METHOD, request_serializer=pb.ProviderFrame.SerializeToString,
                                            response_deserializer=_lenient_frame)
            call = connect()
            interval = await self._handshake(call)
            welcomed_at = time.monotonic()
            outbox = Outbox(self.settings.coordinator_outbox_bytes, self.settings.coordinator_outbox_stall_s)
            tasks = [asyncio.create_task(self._writer(call, outbox), name="writer"),
                     asyncio.create_task(self._reader(call, outbox), name="reader"),
                     asyncio.create_task(self._heartbeats(outbox, interval), name="heartbeat"),
                     asyncio.create_task(self._resend(outbox, list(self.jobs.outcomes.unacked.values())),
                                         name="resend")]
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
            self.connected_since = None
            for t in [*tasks, self._drain_report]:
                if t is not None:
                    t.cancel()
            self._drain_report = None
            self.residency.cancel()  # a load under way goes on; only its answer, to a closed stream, is dropped
            await self.jobs.abandon()
            await channel.close(grace=None)
            self.throttle.flush(log)
            if welcomed_at is not None:
                log.info("coordinator_session_ended", session_id=self.session_id,
                         seconds=round(time.monotonic() - welcomed_at, 3))

    def _healthy(self, welcomed_at: float | None) -> bool:
        return welcomed_at is not None and time.monotonic() - welcomed_at >= self.settings.healthy_session_s

    async def _handshake(self, call) -> float:
        first = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
        if first is grpc.aio.EOF or first is None or isinstance(first, Garbled) \
                or first.WhichOneof("frame") != "challenge":
            raise SessionRejected("the coordinator did not start with a Challenge"
                                  + (" (its first frame did not decode)" if isinstance(first, Garbled) else ""))
        if len(first.challenge.nonce) < MIN_NONCE_BYTES:
            raise SessionRejected(f"the coordinator's nonce is {len(first.challenge.nonce)} bytes; the node signs only "
                                  f"challenges of at least {MIN_NONCE_BYTES} random bytes")
        reg = registration(self.node.status(), self.identity, nonce=first.challenge.nonce,
                           epoch=next_session_epoch(), protocol_version=PROTOCOL_VERSION,
                           software_version=__version__, sealing_key=self.sealing.public_key)
        await call.write(pb.ProviderFrame(hello=self.identity.hello(reg)))
        reply = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
        if reply is grpc.aio.EOF or isinstance(reply, Garbled):
            raise SessionRejected("the coordinator closed the stream or sent garbage during the handshake")
        if reply.WhichOneof("frame") == "reject":
            r = reply.reject
            raise SessionRejected(logs.clip(r.reason), retry_after_s=float(r.retry_after_s), permanent=r.permanent)
        if reply.WhichOneof("frame") != "welcome":
            raise SessionRejected(f"expected Welcome, got {reply.WhichOneof('frame')}")
        w = reply.welcome
        self.session_id, self.coordinator_version = logs.clip(w.session_id), logs.clip(w.coordinator_version)
        self.stats.sessions += 1
        self.jobs.draining = False  # a Drain holds for the session it came on
        # Keys what heartbeats say of the prefixes held; one of a size that is no key: nothing is told.
        self.jobs.held.key = bytes(w.routing_key) if 16 <= len(w.routing_key) <= 64 else b""
        self.welcomed.set()
        self.connected_since = time.time()
        asked = w.heartbeat_interval_ms / 1000 or self.settings.heartbeat_interval_s
        interval = min(max(asked, HEARTBEAT_RANGE_S[0]), HEARTBEAT_RANGE_S[1])
        if interval != asked:
            log.warning("coordinator_heartbeat_clamped", asked_s=asked, used_s=interval)
        log.info("coordinator_welcomed", session_id=self.session_id, epoch=w.session_epoch,
                 node_id=self.identity.node_id, heartbeat_s=interval, coordinator_version=self.coordinator_version,
                 protocol_version=w.protocol_version or 1)
        return interval

    # --- the stream's two directions ------------------------------------------------

    async def _writer(self, call, outbox: asyncio.Queue) -> None:
        while True:
            frame = await outbox.get()
            if frame is _END_OF_STREAM:  # everything queued before it has been written
                await call.done_writing()
                return
            await call.write(frame)

    async def _resend(self, outbox: Outbox, frames: list[pb.ProviderFrame]) -> None:
        """Outcomes the last session may not have recorded, whole, paced by the outbox's room."""
        for frame in frames:
            await outbox.room()
            self.stats.outcomes_resent += 1
            outbox.put_nowait(frame)
        while True:  # then watch that the writer keeps up
            outbox.check()
            await asyncio.sleep(0.25)

    async def _reader(self, call, outbox: Outbox) -> None:
        while True:
            await outbox.room()  # backpressure: no new frame is read while the coordinator leaves ours unread
            frame = await call.read()
            if frame is grpc.aio.EOF:
                log.info("coordinator_closed_stream")
                return
            if isinstance(frame, Garbled):
                self.stats.garbled_frames += 1
                self._protocol_error(outbox, f"the frame did not decode as a CoordinatorFrame: {frame.error}",
                                     frame.size, why="garbled")
                continue
            kind = frame.WhichOneof("frame")
            if kind == "job_request" and not valid_job_id(frame.job_request.job_id):
                # Answered without echoing the id: a JobError under a 64 MiB id is over the frame limit (the node's,
                # or a coordinator's 4 MiB default), and the stream dies.
                job_id = frame.job_request.job_id
                self._protocol_error(outbox, f"job_id must be 1 to {MAX_JOB_ID} characters; this one has {len(job_id)}"
                                     + (f" (it starts {job_id[:40]!r})" if job_id else ""), frame.ByteSize(), kind,
                                     why="job_id")
            elif kind == "job_request":
                self.jobs.on_request(frame.job_request, outbox)
            elif kind == "cancel":
                self.jobs.cancel(frame.cancel.job_id)
            elif kind == "job_ack":
                self.jobs.outcomes.ack(frame.job_ack.job_ids)
            elif kind == "drain":
                self.jobs.draining = True
                if self._drain_report is None or self._drain_report.done():
                    self._drain_report = asyncio.create_task(self._report_drained(outbox), name="drain-report")
            elif kind == "ping":
                outbox.put_nowait(pb.ProviderFrame(pong=pb.Pong(id=frame.ping.id)))
            elif kind == "warm_model":
                self.residency.on_warm(frame.warm_model, outbox)
            elif kind == "release_model":
                self.residency.on_release(frame.release_model, outbox)
            elif kind == "spot_check_result" and not valid_job_id(frame.spot_check_result.job_id):
                self._protocol_error(outbox, f"spot_check_result.job_id must be 1 to {MAX_JOB_ID} characters",
                                     frame.ByteSize(), kind, why="job_id")
            elif kind == "spot_check_result":
                result = frame.spot_check_result
                if (failed := self.verdicts.record(result, self.jobs.outcomes.ran(result.job_id))) is not None:
                    self.throttle.log(log, "warning", "spot_check_failed", **failed)
            elif kind in HANDSHAKE_FRAMES:
                self._protocol_error(outbox, f"{kind} is a handshake frame; the session is already up",
                                     frame.ByteSize(), kind, why=kind)
            else:  # no known case: a newer coordinator's frame, or an empty one
                self._protocol_error(outbox, "the frame has no case this node knows (protocol version "
                                     f"{PROTOCOL_VERSION})", frame.ByteSize(), why="unknown")

    def _protocol_error(self, outbox: asyncio.Queue, reason: str, size: int, kind: str = "", *, why: str) -> None:
        """Tell the coordinator which frame could not be used; drop it and keep the session. Every one is
        answered; the log line is throttled per `why` (a closed set), since a coordinator can send them at will."""
        self.stats.protocol_errors += 1
        self.throttle.log(log, "warning", "coordinator_protocol_error", why, reason=reason, frame_bytes=size,
                          frame_kind=kind)
        outbox.put_nowait(pb.ProviderFrame(protocol_error=pb.ProtocolError(reason=reason, frame_bytes=size,
                                                                           frame_kind=kind)))

    async def _heartbeats(self, outbox: Outbox, interval: float) -> None:
        while True:
            if not outbox.over:  # an unread heartbeat says nothing; the next one will
                held = self.jobs.held.newest(self.node.holds_prefix)  # what the prefix caches still serve
                outbox.put_nowait(pb.ProviderFrame(heartbeat=heartbeat(
                    self.node.status(), draining=self.jobs.draining, prefix_hashes=held)))
            await asyncio.sleep(interval)

    # --- draining ---------------------------------------------------------------------

    async def _report_drained(self, outbox: asyncio.Queue) -> None:
        finished = await self.jobs.finish()
        outbox.put_nowait(pb.ProviderFrame(drained=pb.Drained(jobs_finished=finished)))
        log.info("coordinator_drained", jobs_finished=finished)

    async def _drain_and_close(self, call, outbox: asyncio.Queue, tasks: list[asyncio.Task]) -> None:
        """Shutting down: accept nothing new, let jobs finish within the grace period, say so, close."""
        self.jobs.draining = True
        outbox.put_nowait(pb.ProviderFrame(heartbeat=heartbeat(self.node.status(), draining=True)))
        try:
            await asyncio.wait_for(self._report_drained(outbox), self.settings.shutdown_grace_s)
        except asyncio.TimeoutError:
            log.warning("coordinator_drain_timeout", jobs=len(self.jobs))
        outbox.put_nowait(_END_OF_STREAM)
        writer = tasks[0]
        try:
            await asyncio.wait_for(asyncio.shield(writer), 5)
            await asyncio.wait_for(call.code(), 5)  # the coordinator has read everything and ended the call
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            log.warning("coordinator_close_unclean")
