"""Coordinator jobs, from JobRequest to their one outcome.

A JobRequest is opened (when sealed), checked (fields, pin, deadline, draining) and run as the same `Job`
the local API makes; its Events go back as frames in order, with per-job sequence numbers, sealed back
to the sender when the job was sealed. Each job ends with exactly one outcome, recorded in `Outcomes`
until the coordinator acknowledges it. Delivery of requests is at least once: a repeated job id never
runs twice, and once finished it gets the same outcome again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass

from provider import logs
from provider.jobs import JobError
from provider.outputs import Accepted, Done, Error, Tokens
from provider.types import Cause
from provider.node import Node
from provider.settings import Settings

from . import convert
from .identity import Identity
from .outcomes import SIGNATURE_LAYOUT, Outcomes, Transcript, is_sha256_hex, request_digest, result_bytes
from .pb import provider_pb2 as pb
from .routing import HeldPrefixes
from .sealing import JobKeys, SealingError, SealingKey

log = logs.get("coordinator")
_CONVERTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="coordinator-admit")
ROUTING_FIELDS = ("job_id", "model", "deadline_ms", "model_sha256")  # stay in the clear on a sealed job


@dataclass
class ServingStats:
    jobs_received: int = 0
    outcomes_sent: int = 0
    coordinator_lost: int = 0


def _access_log(job_id: str, frame: pb.ProviderFrame, started: float | None,
                throttle: logs.Throttle | None = None) -> None:
    """One line per coordinator job: how it ended, how long it took, its token counts; never its text. Jobs
    refused at the door cost their sender nothing, so their lines pass `throttle`, per cause."""
    kind = frame.WhichOneof("frame")
    fields = {"job_id": job_id, "outcome": kind,
              "duration_ms": round((time.perf_counter() - started) * 1000, 3) if started else 0.0}
    if kind == "job_done":
        u = frame.job_done.usage
        fields |= {"finish_reason": frame.job_done.finish_reason, "prompt_tokens": u.prompt_tokens,
                   "completion_tokens": u.completion_tokens}
    else:
        fields["cause"] = pb.ErrorCause.Name(frame.job_error.cause)
    if throttle is None:
        log.info("coordinator_job", **fields)
    else:
        throttle.log(log, "info", "coordinator_job", f"refused:{fields.get('cause', '')}", **fields)


def open_request(req: pb.JobRequest, sealing: SealingKey, *, required: bool) -> tuple[pb.JobRequest, JobKeys | None]:
    """The request to run and, for a sealed one, the keys its answers are sealed with; JobError(SEALING_FAILED)
    when a sealed body does not open or a plaintext one comes while sealing is required. Never a fallback."""
    if not req.HasField("sealed"):
        if required:
            raise JobError(Cause.SEALING_FAILED, "this node requires sealed jobs (require_sealed_jobs = true); "
                           "seal the body to the sealing_key in its Registration")
        return req, None
    try:
        body, keys = sealing.open_job(req.job_id, req.sealed)
    except SealingError as e:
        raise JobError(Cause.SEALING_FAILED, f"the sealed job did not open: {e}; seal it to the sealing_key of "
                       "this node's current session (it changes when the node restarts)") from None
    if body.job_id not in ("", req.job_id) or body.HasField("sealed"):
        raise JobError(Cause.SEALING_FAILED, "the sealed body names another job_id or is sealed again")
    merged = pb.JobRequest()
    merged.CopyFrom(req)
    merged.ClearField("sealed")
    for name in ROUTING_FIELDS:
        body.ClearField(name)
    merged.MergeFrom(body)
    return merged, keys


class CoordinatorJobs:
    def __init__(self, node: Node, settings: Settings, identity: Identity, sealing: SealingKey, *,
                 coalesce_s: float, throttle: logs.Throttle | None = None):
        self.node = node
        self.coalesce_s = coalesce_s
        self.settings = settings
        self.identity = identity
        self.sealing = sealing
        self.outcomes = Outcomes()
        self.stats = ServingStats()
        self.draining = False
        self.throttle = throttle or logs.Throttle()
        self._running: dict[str, asyncio.Task] = {}
        self._started: dict[str, float] = {}  # job id -> when it was accepted, for the access log
        self._cancelled: set[str] = set()  # cancels that came before the job reached the engine
        self.held = HeldPrefixes()  # conversation prefixes its finished jobs left cached (routing.py)

    def __len__(self) -> int:
        return len(self._running)

    def cancel(self, job_id: str) -> None:
        if job_id in self._running:
            self._cancelled.add(job_id)
            self.node.cancel(job_id)

    def on_request(self, req: pb.JobRequest, outbox: asyncio.Queue) -> None:
        """A JobRequest whose job id the session has checked (it answers a bad one with a ProtocolError)."""
        self.stats.jobs_received += 1
        if req.job_id in self._running:
            self.throttle.log(log, "info", "coordinator_duplicate_job", "running", job_id=req.job_id, state="running")
            return
        finished = self.outcomes.finished(req.job_id)
        if finished is not None:
            self.throttle.log(log, "info", "coordinator_duplicate_job", "finished", job_id=req.job_id,
                              state="finished")
            outbox.put_nowait(finished)
            return
        try:
            convert.check_job_id(req.job_id)  # before anything: the id is hashed into the keys and associated data
        except JobError as e:
            if convert.valid_job_id(req.job_id):  # a bad id is never stored, nor echoed (see the session)
                self._outcome(outbox, convert.error_frame(req.job_id, e.cause, e.message, sealed=req.HasField(
                    "sealed"), param=e.param), req.job_id, refused=True)
            return
        self._started[req.job_id] = time.perf_counter()
        task = asyncio.create_task(self._serve(req, outbox))
        self._running[req.job_id] = task
        task.add_done_callback(lambda _: self._running.pop(req.job_id, None))

    def _admitted(self, req: pb.JobRequest) -> tuple:
        """On the converter thread (a 64 MiB request takes ~0.6 s to open, convert and hash, which would
        hold every other job's frames and the heartbeats): the job to run, its request opened, its keys and
        the digest its result signs; JobError when it is refused at the door."""
        s = self.settings
        received, sealed = req, req.HasField("sealed")
        req, keys = open_request(req, self.sealing, required=s.require_sealed_jobs)
        job = convert.job_from_request(req, max_tokens_limit=s.max_tokens_limit,
                                       default_max_tokens=s.default_max_tokens, sealed=sealed)
        if req.deadline_ms and req.deadline_ms <= time.time() * 1000:
            raise JobError(Cause.DEADLINE_EXCEEDED, "the job's deadline passed before it started")
        if req.model_sha256 and not is_sha256_hex(req.model_sha256):
            raise JobError(Cause.INVALID_REQUEST, "model_sha256 must be 64 lowercase hex digits (the hash the "
                           "node registered for the model)", "model_sha256")
        return job, req, keys, request_digest(received)

    async def _serve(self, req: pb.JobRequest, outbox: asyncio.Queue) -> None:
        """The job's whole life, its admission and pin check included, in one `try`: every way out records exactly
        one outcome (its end, a refusal, an error, or COORDINATOR_LOST when the session is abandoned) and stops
        the engine job."""
        job_id, sealed, keys = req.job_id, req.HasField("sealed"), None
        transcript, model, stream, timer = Transcript(), "", None, None
        expired = []  # set when the deadline cancelled the job: its end is then DEADLINE_EXCEEDED, not "cancelled"
        answer: list[str] = []
        ended = []

        def end(frame: pb.ProviderFrame, to: asyncio.Queue | None = outbox) -> None:
            if not ended:
                ended.append(True)
                self._outcome(to, frame, job_id)

        try:
            try:
                job, req, keys, request_sha256 = await asyncio.get_running_loop().run_in_executor(
                    _CONVERTER, self._admitted, req)
                if self.draining or self.node.draining:
                    raise JobError(Cause.DRAINING, "the node is draining and accepts no new jobs")
            except JobError as e:
                self._outcome(outbox, convert.error_frame(job_id, e.cause, e.message, sealed=sealed, param=e.param),
                              job_id, refused=True)
                return
            if req.model_sha256:  # before the job reaches the engine, so weights that do not match never load
                await asyncio.to_thread(self.node.check_pin, job.model, req.model_sha256)
            stream = self.node.run(job)
            if job_id in self._cancelled:  # cancelled during the pin check: the engine ends it at once
                self.node.cancel(job_id)
            if req.deadline_ms:
                delay = max(0.0, req.deadline_ms / 1000 - time.time())
                timer = asyncio.get_running_loop().call_later(
                    delay, lambda: (expired.append(True), self.node.cancel(job_id)))
            async for ev in stream:
                if isinstance(ev, Accepted):
                    model = ev.model
                    outbox.put_nowait(pb.ProviderFrame(job_accepted=pb.JobAccepted(
                        job_id=job_id, model=ev.model, prompt_tokens=ev.prompt_tokens,
                        seal_salt=keys.run_salt if keys else b"")))
                    continue
                tokens, last = (await stream.coalesce(ev, behind=lambda: not outbox.empty(),
                                                      window_s=self.coalesce_s)
                                if isinstance(ev, Tokens) else ([], ev))
                if tokens:
                    answer.extend(t.text for t in tokens)
                    body = convert.chunk_body(tokens)
                    outbox.put_nowait(convert.chunk_frame(job_id, transcript.chunks, body, keys))
                    transcript.add(body)
                if last is not None:
                    weights = await self._weights_hash(model or self.node.resolve_model(job.model)) \
                        if isinstance(last, Done) else ""
                    end(self._ending(last, transcript, weights, keys, deadline_passed=bool(expired),
                                     request_sha256=request_sha256))
                    if isinstance(last, Done) and not sealed:  # what its prefix cache now holds, for routing
                        self.held.record(req.model, req.cache_scope, job, "".join(answer), model or "")
        except asyncio.CancelledError:
            # The session was abandoned under this job (during its pin check, before its first step, or while
            # it ran): stop generating, report it on the next session.
            self.stats.coordinator_lost += 1
            frame = convert.error_frame(job_id, Cause.COORDINATOR_LOST, "the coordinator stream died while the job "
                                        "ran; it was cancelled", sealed=sealed)
            frame.job_error.completion.CopyFrom(transcript.completion(job_id, keys))
            end(frame, None)
            raise
        except JobError as e:  # the pin did not match, or could not be checked
            end(convert.error_frame(job_id, e.cause, e.message, sealed=sealed, param=e.param))
        except Exception as e:  # a bug (converting, signing, sealing): the job still gets its one outcome
            log.exception("coordinator_job_failed", job_id=job_id)
            end(convert.error_frame(job_id, Cause.INTERNAL, f"serving the job failed: {type(e).__name__}",
                                    sealed=sealed))
        finally:
            self._cancelled.discard(job_id)
            self._started.pop(job_id, None)
            if timer:
                timer.cancel()
            if stream is not None:
                await stream.aclose()  # a job whose serving failed stops generating; an ended one is untouched

    async def _weights_hash(self, model: str) -> str:
        """The manifest hash a JobDone signs: the one registered, or, for a model that was not on disk then,
        computed now (off the event loop). A model whose files cannot be hashed leaves "", which no result signs."""
        if not self.node.model_hash(model):
            await asyncio.to_thread(self.node.hash_models)
        return self.node.model_hash(model)

    def _ending(self, end, transcript: Transcript, weights: str, keys: JobKeys | None, *,
                deadline_passed: bool, request_sha256: bytes) -> pb.ProviderFrame:
        proof = convert.proof_to_pb(end.proof) if isinstance(end, Done) else None
        completion = transcript.completion(end.job_id, keys, proof)
        if isinstance(end, Done) and deadline_passed and end.finish_reason == "cancelled":
            frame = convert.error_frame(end.job_id, Cause.DEADLINE_EXCEEDED, "the job's deadline passed after "
                                        f"{end.usage.completion_tokens} tokens", end.usage, sealed=keys is not None)
            frame.job_error.completion.CopyFrom(completion)
        elif isinstance(end, Done):
            frame = convert.done_frame(end)
            done = frame.job_done
            if keys is not None:  # how many drafts the output accepted is about its text: not said in the clear
                done.telemetry.ClearField("speculation")
            done.completion.CopyFrom(completion)
            done.model_sha256 = weights
            done.signature_layout, done.request_sha256 = SIGNATURE_LAYOUT, request_sha256
            done.signature = self.identity.sign(result_bytes(done))
        elif isinstance(end, Error):
            frame = convert.event_error_frame(end, sealed=keys is not None)
            if transcript.chunks:
                frame.job_error.completion.CopyFrom(completion)
        else:
            raise TypeError(f"not a job's end: {end!r}")
        return frame

    def _outcome(self, outbox: asyncio.Queue | None, frame: pb.ProviderFrame, job_id: str, *,
                 refused: bool = False) -> None:
        """Record a job's single outcome until the coordinator acks it, and send it if a stream is up."""
        _access_log(job_id, frame, self._started.pop(job_id, None), self.throttle if refused else None)
        first = self.outcomes.record(job_id, frame)
        self.stats.outcomes_sent += 1
        if outbox is not None:
            outbox.put_nowait(first)

    async def abandon(self) -> None:
        """The stream died: cancel every running job (each records COORDINATOR_LOST)."""
        running = list(self._running.values())
        for t in running:
            t.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)

    async def finish(self) -> int:
        """Wait for every running job to end; how many there were."""
        finished = len(self._running)
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)
        return finished
