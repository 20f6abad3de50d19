"""A reference coordinator: the other side of the contract, for tests, benchmarks and local development.

A real grpc.aio server on loopback. It challenges each provider with a fresh
nonce, verifies the signed registration (signature, nonce, clock skew, epoch),
replaces an older session of the same node, dispatches jobs (sealed ones too),
checks each result's signature and digest before acknowledging it, rebuilds
completions, and records every frame. Its records live in this object, so a
`kill()` followed by `restart()` models a coordinator process that restarts
with its job store intact.

    python -m coordinator_client.reference_coordinator --port 50051
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import grpc

from .identity import InvalidSignature, admit_hello
from .outcomes import InvalidResult, proof_digest, token_digest, verify_result
from .pb import provider_pb2 as pb
from .sealing import JobKeys, SealingError, SenderKeys, seal_job
from .network_terms import network_terms
from .routing import Router
from .spot_checks import DEFAULT_VERIFY_FRACTION, SpotChecks, proof_of

VERSION = "reference-coordinator/1"
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),  # docs/protocol.md: 64 MiB frames each way (grpc's default: 4)
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 1),
]


@dataclass
class NodeSession:
    session_id: str
    node_id: str
    epoch: int
    registration: pb.Registration
    peer: str = ""  # gRPC's peer address ("ipv4:203.0.113.5:40000"): spot checks keep siblings apart
    outgoing: asyncio.Queue = field(default_factory=asyncio.Queue)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    heartbeats: list[pb.Heartbeat] = field(default_factory=list)


def _serialize(frame) -> bytes:
    # Bytes pass through untouched, so tests can put garbled frames on the wire.
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


class ReferenceCoordinator:
    def __init__(self, port: int = 0, heartbeat_interval_ms: int = 500, ack_outcomes: bool = True,
                 nonce_bytes: int = 32, read_frames: bool = True, verify_fraction: float = DEFAULT_VERIFY_FRACTION,
                 verify_seed: int | None = None):
        self.port = port
        self.spot_checks = SpotChecks(verify_fraction, verify_seed)  # jobs verified again on another node
        self.router = Router(secrets.token_bytes(32))  # cache-aware routing (routing.dispatch_routed)
        self.read_frames = read_frames  # False: after the handshake it sends but never reads (flow-control tests)
        self.nonce_bytes = nonce_bytes  # tests set it below 16 to check that the node refuses to sign
        self.hellos = 0  # Hello frames received
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.ack_outcomes = ack_outcomes
        self._server: grpc.aio.Server | None = None
        self.sessions: dict[str, NodeSession] = {}  # node_id -> current session
        self.epochs: dict[str, int] = {}  # node_id -> highest epoch seen
        self.frames: list[tuple[str, str, pb.ProviderFrame]] = []  # (session id, kind, frame)
        self.outcomes: dict[str, list[pb.ProviderFrame]] = defaultdict(list)  # job id -> JobDone/JobError frames
        self.chunks: dict[str, list[pb.TokenChunk]] = defaultdict(list)
        self.chunk_arrivals: dict[str, list[float]] = defaultdict(list)  # perf_counter() per chunk
        self.accepted: dict[str, pb.JobAccepted] = {}
        self.rejections: list[str] = []
        self.drained: list[pb.Drained] = []
        self.protocol_errors: list[pb.ProtocolError] = []
        self.bad_results: dict[str, str] = {}  # job id -> why its JobDone was refused (never acknowledged)
        self.next_reject: pb.Reject | None = None  # refuse the next Hello with this, to test the node's reaction
        self.requests: dict[str, pb.JobRequest] = {}  # job id -> the request sent (a result must answer it)
        self.plain_requests: dict[str, pb.JobRequest] = {}  # a sealed job's request before it was sealed
        self.next_challenge: bytes | None = None  # send these bytes instead of the next Challenge (garbage tests)
        self._job_keys: dict[str, SenderKeys] = {}  # sealed jobs' keys, to open what comes back
        self._run_keys: dict[str, JobKeys] = {}  # and the keys of their current run (JobAccepted.seal_salt)
        self._outcome_waiters: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._session_changed = asyncio.Condition()
        self._issued_nonces: set[bytes] = set()

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> int:
        # One that never reads keeps HTTP/2's initial window: grpc's BDP probe would otherwise grow it to megabytes
        # read into grpc's buffers (nobody's memory a test can see) before the node's outbox fills.
        unread = [] if self.read_frames else [("grpc.http2.bdp_probe", 0)]
        self._server = grpc.aio.server(options=SERVER_OPTIONS + unread)
        handler = grpc.stream_stream_rpc_method_handler(
            self._connect, request_deserializer=pb.ProviderFrame.FromString, response_serializer=_serialize)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("provider.v1.Coordinator", {"Connect": handler}),))
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self._server.start()
        return self.port

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    async def kill(self) -> None:
        """Stop abruptly: every stream is cut, nothing is drained."""
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        for s in self.sessions.values():
            s.ended.set()
        self.sessions.clear()

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    # --- what tests drive -----------------------------------------------------------

    async def wait_for_node(self, timeout: float = 60, after: str | None = None) -> NodeSession:
        """The current session of the (only) node; with `after`, one newer than that session id."""
        async with self._session_changed:
            await asyncio.wait_for(self._session_changed.wait_for(
                lambda: any(s.session_id != after for s in self.sessions.values())), timeout)
            return next(s for s in self.sessions.values() if s.session_id != after)

    def send(self, session: NodeSession, frame: pb.CoordinatorFrame | bytes) -> None:
        session.outgoing.put_nowait(frame)

    def dispatch(self, session: NodeSession, request: pb.JobRequest) -> str:
        network_terms(request)
        self.requests[request.job_id] = request  # what its result must answer
        self.send(session, pb.CoordinatorFrame(job_request=request))
        return request.job_id

    def dispatch_sealed(self, session: NodeSession, request: pb.JobRequest) -> str:
        """Send `request` with everything but its routing fields sealed to the node's session key."""
        network_terms(request)
        outer = pb.JobRequest(job_id=request.job_id, model=request.model, deadline_ms=request.deadline_ms,
                              model_sha256=request.model_sha256)
        sealed, keys = seal_job(session.registration.sealing_key, request.job_id, request)
        self.plain_requests[request.job_id] = request
        outer.sealed.CopyFrom(sealed)
        self._job_keys[request.job_id] = keys
        self.dispatch(session, outer)  # its result answers the sealed request, as sent
        return request.job_id

    async def outcome(self, job_id: str, timeout: float = 120) -> pb.ProviderFrame:
        await asyncio.wait_for(self._outcome_waiters[job_id].wait(), timeout)
        return self.outcomes[job_id][0]

    def text(self, job_id: str) -> str:
        return "".join(c.text for c in self.chunks[job_id])

    def token_ids(self, job_id: str) -> list[int]:
        return [t for c in self.chunks[job_id] for t in c.token_ids]

    def tool_calls(self, job_id: str) -> list[pb.ToolCall]:
        return [call for c in self.chunks[job_id] for call in c.tool_calls]

    def completion(self, job_id: str) -> tuple[str, list[int]]:
        """The job's whole output, rebuilt from its chunks or, when chunks were lost with a session, from the
        completion its re-sent outcome carries; checked against the outcome's digest either way."""
        frame = self.outcomes[job_id][-1]
        outcome = frame.job_done if frame.HasField("job_done") else frame.job_error
        if not outcome.HasField("completion"):
            return "", []  # an error before the job ran
        c, keys = outcome.completion, self._keys(job_id, outcome.completion.seal_salt)
        if c.sealed:
            c = keys.open_completion(job_id, c.sealed)
        if c.token_ids or c.text:
            text, ids = c.text, list(c.token_ids)
        else:
            text, ids = self.text(job_id), self.token_ids(job_id)
        if token_digest(ids, keys) != outcome.completion.token_ids_sha256:
            raise ValueError(f"{job_id}: {len(ids)} tokens do not match the outcome's digest (a truncated result)")
        return text, ids

    def check_result(self, session: NodeSession, done: pb.JobDone) -> str | None:
        """Why a JobDone cannot be accepted (bad signature, or a digest that does not match what arrived),
        or None. Chunks may be missing only if the outcome carries the whole completion."""
        try:
            verify_result(done, session.registration.public_key, self.requests.get(done.job_id))
        except InvalidSignature:
            return "the result's signature does not verify with the node's key"
        except InvalidResult as e:
            return f"the result is refused: {e}"
        c, keys = done.completion, self._keys(done.job_id, done.completion.seal_salt)
        if c.sealed and keys is None:  # relayed for another sender, which alone can open it and check its digest
            sent = self.requests.get(done.job_id)
            return "a sealed completion for a job sent in the clear" if sent and not sent.HasField("sealed") else None
        try:
            proof = proof_of(self, done)
        except SealingError:
            return "the sealed proof does not open with the job's keys"
        if proof is not None and proof_digest(proof, keys) != done.completion.proof_sha256:
            return "the proof does not match its signed digest"
        if c.sealed:
            try:
                c = keys.open_completion(done.job_id, c.sealed)
            except SealingError:
                return "the sealed completion does not open with the job's keys"
        if c.token_ids or c.text:
            return None if token_digest(c.token_ids, keys) == done.completion.token_ids_sha256 else \
                "the completion does not match its digest"
        sent = done.completion.chunks
        if len(self.chunks[done.job_id]) != sent:
            return f"{len(self.chunks[done.job_id])} of {sent} chunks arrived and the outcome has no completion"
        if token_digest(self.token_ids(done.job_id), keys) != done.completion.token_ids_sha256:
            return "the chunks that arrived do not match the result's digest"
        return None

    # --- the RPC ---------------------------------------------------------------------

    async def _connect(self, request_iterator, context: grpc.aio.ServicerContext):
        nonce = secrets.token_bytes(self.nonce_bytes)
        self._issued_nonces.add(nonce)
        if self.next_challenge is not None:
            garbage, self.next_challenge = self.next_challenge, None
            await context.write(garbage)
        else:
            await context.write(pb.CoordinatorFrame(challenge=pb.Challenge(nonce=nonce,
                                                                           server_time_ms=int(time.time() * 1000))))
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        self.hellos += first.WhichOneof("frame") == "hello"
        reason = admit_hello(first, nonce, self._issued_nonces, self.epochs)
        if not isinstance(reason, str) and self.next_reject is not None:
            reject, self.next_reject = self.next_reject, None
            self.rejections.append(reject.reason)
            await context.write(pb.CoordinatorFrame(reject=reject))
            return
        if isinstance(reason, str):
            self.rejections.append(reason)
            await context.write(pb.CoordinatorFrame(reject=pb.Reject(reason=reason)))
            return
        reg: pb.Registration = reason
        session = NodeSession(f"s-{uuid.uuid4().hex[:12]}", reg.node_id, reg.session_epoch, reg, context.peer())
        old = self.sessions.get(reg.node_id)
        if old is not None:
            old.ended.set()  # a rejoin replaces the ghost session
        async with self._session_changed:
            self.sessions[reg.node_id] = session
            self._session_changed.notify_all()
        await context.write(pb.CoordinatorFrame(welcome=pb.Welcome(
            session_id=session.session_id, session_epoch=reg.session_epoch,
            heartbeat_interval_ms=self.heartbeat_interval_ms, coordinator_version=VERSION, protocol_version=1,
            routing_key=self.router.key)))
        reader = asyncio.create_task(self._read(context, session) if self.read_frames else asyncio.Event().wait())
        ended = asyncio.create_task(session.ended.wait())
        get = None
        try:
            while not session.ended.is_set():
                get = asyncio.create_task(session.outgoing.get())
                done, _ = await asyncio.wait({get, ended, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    await context.write(get.result())
                else:
                    break
        finally:
            for t in (reader, ended, get):
                if t is not None:
                    t.cancel()
            if self.sessions.get(reg.node_id) is session:
                del self.sessions[reg.node_id]

    async def _read(self, context, session: NodeSession) -> None:
        while True:
            frame = await context.read()
            if frame is grpc.aio.EOF:
                return
            kind = frame.WhichOneof("frame")
            self.frames.append((session.session_id, kind, frame))
            if kind == "heartbeat":
                session.heartbeats.append(frame.heartbeat)
                self.router.heard(session.node_id, frame.heartbeat.prefix_hashes)
            elif kind == "job_accepted":
                self.accepted[frame.job_accepted.job_id] = frame.job_accepted
                sender = self._job_keys.get(frame.job_accepted.job_id)
                if sender is not None and frame.job_accepted.seal_salt:
                    self._run_keys[frame.job_accepted.job_id] = sender.for_run(frame.job_accepted.seal_salt)
            elif kind == "token_chunk":
                self.chunks[frame.token_chunk.job_id].append(self._opened(frame.token_chunk))
                self.chunk_arrivals[frame.token_chunk.job_id].append(time.perf_counter())
            elif kind in ("job_done", "job_error"):
                job_id = getattr(frame, kind).job_id
                if kind == "job_done" and (why := self.check_result(session, frame.job_done)):
                    self.bad_results[job_id] = why  # not recorded and not acknowledged: the node sends it again
                    continue
                self.outcomes[job_id].append(frame)
                self._outcome_waiters[job_id].set()
                self.spot_checks.after(self, session, job_id, frame)
                self.router.finished(session.node_id, job_id, frame.job_done.usage.cached_prompt_tokens)
                if self.ack_outcomes:
                    session.outgoing.put_nowait(pb.CoordinatorFrame(job_ack=pb.JobAck(job_ids=[job_id])))
            elif kind == "drained":
                self.drained.append(frame.drained)
            elif kind == "protocol_error":
                self.protocol_errors.append(frame.protocol_error)

    def _keys(self, job_id: str, seal_salt: bytes) -> JobKeys | None:
        """A sealed job's keys for the run that announced `seal_salt`, which open its answers and key its digest;
        None for a plain job (or one sealed by another sender)."""
        sender = self._job_keys.get(job_id)
        return sender.for_run(seal_salt) if sender is not None and seal_salt else None

    def _opened(self, chunk: pb.TokenChunk) -> pb.TokenChunk:
        if not chunk.sealed:
            return chunk
        try:
            body = self._run_keys[chunk.job_id].open_chunk(chunk.job_id, chunk.seq, chunk.sealed)
        except (KeyError, SealingError):
            return chunk  # not ours to open: kept as it came
        body.job_id, body.seq = chunk.job_id, chunk.seq
        return body


async def _main(port: int, verify_fraction: float) -> None:
    coord = ReferenceCoordinator(port, verify_fraction=verify_fraction)
    await coord.start()
    print(f"reference coordinator listening on {coord.url}; seeding every sampled job; spot-checking "
          f"{verify_fraction:.0%} of jobs on another node", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", "50051")))
    ap.add_argument("--verify-fraction", type=float, default=DEFAULT_VERIFY_FRACTION, help="re-verify this "
                    f"share of finished jobs on another connected node (0 to 1; default {DEFAULT_VERIFY_FRACTION})")
    asyncio.run(_main(**vars(ap.parse_args())))
