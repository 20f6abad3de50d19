"""Job outcomes on the wire: what a job emitted, the signed result, and the store that sends them again.

Every outcome says how many chunks the job sent and carries a SHA-256 over its token ids, so a coordinator
can tell a whole result from a truncated one. The first send leaves the completion's text and token ids
out (the chunks carried them); every later send (a new session, a repeated JobRequest) puts them in, so a
coordinator that lost chunks can rebuild the result. JobDone is signed by the node identity; the byte
layout is in the proto, above `JobDone.signature`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from provider import logs

from .pb import provider_pb2 as pb
from .sealing import JobKeys, padded

log = logs.get("coordinator")

RESULT_DOMAIN = b"provider.v1.result\0"
# 3 signs the proof's digest too; 2 signed none, 0 was the NUL-joined layout (a job id holding NUL made two
# results sign the same bytes): both refused.
SIGNATURE_LAYOUT = 3
MAX_UNACKED = 10_000
MAX_UNACKED_BYTES = 64 << 20  # a coordinator that never acks holds at most this much of them
MAX_FINISHED = 10_000  # outcomes kept to answer a repeated JobRequest (ids older than that count as new)
MAX_FINISHED_BYTES = 64 << 20  # and at most this much of them, completions included


def is_sha256_hex(s: str) -> bool:
    """The one spelling of a SHA-256 on the wire: 64 lowercase hex digits."""
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def token_digest(token_ids, keys: JobKeys | None = None) -> bytes:
    """SHA-256 over the token ids (each a 4-byte little-endian uint32); for a sealed job, HMAC-SHA256 under the
    run's digest key instead: a plain hash in the clear let a relaying coordinator confirm a guessed output."""
    data = b"".join(int(t).to_bytes(4, "little") for t in token_ids)
    return hashlib.sha256(data).digest() if keys is None else hmac.new(keys.digest, data, hashlib.sha256).digest()


def proof_digest(proof: pb.Proof, keys: JobKeys | None = None) -> bytes:
    """SHA-256 over the Proof serialized deterministically; HMAC-SHA256 under the run's digest key for a sealed
    job, as the token digest (a commitment in the clear would let a coordinator test a guessed output)."""
    data = proof.SerializeToString(deterministic=True)
    return hashlib.sha256(data).digest() if keys is None else hmac.new(keys.digest, data, hashlib.sha256).digest()


@dataclass
class Transcript:
    """What one job has streamed so far."""

    chunks: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[pb.ToolCall] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)

    def add(self, body: pb.TokenChunk) -> None:
        """One chunk's body (as it was sent, before any sealing)."""
        self.chunks += 1
        self.text.append(body.text)
        self.token_ids.extend(body.token_ids)
        self.tool_calls.extend(body.tool_calls)
        self.logprobs.extend(body.logprobs)
        self.prompt_logprobs.extend(body.prompt_logprobs)

    def completion(self, job_id: str, keys: JobKeys | None = None, proof: pb.Proof | None = None) -> pb.Completion:
        """The whole completion (with the job's proof, when the node commits), sealed back to the sender for a
        sealed job."""
        proof = proof or pb.Proof()
        out = pb.Completion(chunks=self.chunks, token_ids_sha256=token_digest(self.token_ids, keys),
                            proof_sha256=proof_digest(proof, keys))
        if proof.ByteSize():
            if keys is not None:
                out.sealed_proof = keys.seal_proof(job_id, proof)
            else:
                out.proof.CopyFrom(proof)
        body = pb.Completion(text="".join(self.text), token_ids=self.token_ids, tool_calls=self.tool_calls,
                             logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)
        if keys is not None:
            out.sealed = keys.seal_completion(job_id, padded(body))
            out.seal_salt = keys.run_salt
        else:
            out.MergeFrom(body)
        return out


def request_digest(req: pb.JobRequest) -> bytes:
    """The hash a result commits to: the request as the node received it (a sealed one as sealed, so the hash
    in the clear is of ciphertext), serialized deterministically."""
    return hashlib.sha256(req.SerializeToString(deterministic=True)).digest()


class InvalidResult(ValueError):
    """A JobDone whose signed fields cannot be what a node signs (another layout, a digest of the wrong size, a
    model hash not spelled as 64 lowercase hex digits), or that answers another request."""


def result_bytes(done: pb.JobDone) -> bytes:
    """What JobDone.signature signs: layout 3 (the proto, above `JobDone.signature`), every field
    length-prefixed. InvalidResult for a model hash that is not canonical: "", a short one and "0" * 64 all
    signed 32 zero bytes, and upper and lower case the same bytes."""
    c, u = done.completion, done.usage
    if not is_sha256_hex(done.model_sha256):
        raise InvalidResult("model_sha256 must be 64 lowercase hex digits (the manifest hash of the weights)")
    model = bytes.fromhex(done.model_sha256)
    verdict = hashlib.sha256(done.verdict.SerializeToString(deterministic=True)).digest()
    fields = (done.job_id.encode(), done.finish_reason.encode(), c.token_ids_sha256, done.request_sha256, model,
              c.proof_sha256, verdict)
    counts = (c.chunks, u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    return (RESULT_DOMAIN + SIGNATURE_LAYOUT.to_bytes(4, "big")
            + b"".join(len(f).to_bytes(4, "big") + f for f in fields)
            + b"".join(n.to_bytes(8, "big") for n in counts))


def verify_result(done: pb.JobDone, public_key: bytes, request: pb.JobRequest | None = None) -> None:
    """Raise InvalidResult unless `done` is in the signing layout this code knows, with 32-byte digests and a
    canonical model hash, and answers `request` (the JobRequest the coordinator sent, when given);
    InvalidSignature unless it is signed by `public_key` (the node's Registration.public_key). Nothing else:
    a malformed result is a typed refusal, never a ValueError out of a coordinator's reader."""
    if done.signature_layout != SIGNATURE_LAYOUT:
        raise InvalidResult(f"signature layout {done.signature_layout}; only {SIGNATURE_LAYOUT} is accepted")
    c = done.completion
    if len(c.token_ids_sha256) != 32 or len(done.request_sha256) != 32 or len(c.proof_sha256) != 32:
        raise InvalidResult("token_ids_sha256, request_sha256 and proof_sha256 must be 32 bytes")
    if request is not None and request_digest(request) != done.request_sha256:
        raise InvalidResult("the result answers another request than the one sent under its job id")
    signed = result_bytes(done)
    if len(public_key) != 32:
        raise InvalidResult("the node's public key must be 32 bytes")
    Ed25519PublicKey.from_public_bytes(public_key).verify(done.signature, signed)


def brief(frame: pb.ProviderFrame) -> pb.ProviderFrame:
    """The outcome as first sent: the completion's body left out, since the chunks carried it."""
    out = pb.ProviderFrame()
    out.CopyFrom(frame)
    kind = out.WhichOneof("frame")
    if kind in ("job_done", "job_error") and getattr(out, kind).HasField("completion"):
        c = getattr(out, kind).completion
        c.text, c.sealed = "", b""
        for repeated in (c.token_ids, c.tool_calls, c.logprobs, c.prompt_logprobs):
            del repeated[:]
    return out


class Outcomes:
    """Each job's single outcome, kept until acknowledged (to send again on the next session) and for a while
    after (to answer a repeated JobRequest with the same outcome)."""

    def __init__(self):
        self.unacked: dict[str, pb.ProviderFrame] = {}  # oldest first
        self._unacked_sizes: dict[str, int] = {}
        self.unacked_bytes = 0
        self.dropped = 0  # outcomes dropped unacknowledged, oldest first
        self._finished: dict[str, tuple[pb.ProviderFrame, int]] = {}  # job id -> (outcome, its size)
        self._finished_bytes = 0

    def record(self, job_id: str, frame: pb.ProviderFrame) -> pb.ProviderFrame:
        """Keep the whole outcome; return the brief one to send now."""
        size = frame.ByteSize()
        self._drop_unacked(job_id)
        # A coordinator that never acks must not grow us forever: bounded in count and in bytes, oldest first.
        while self.unacked and (len(self.unacked) >= MAX_UNACKED or self.unacked_bytes + size > MAX_UNACKED_BYTES):
            oldest = next(iter(self.unacked))
            self.dropped += 1
            if self.dropped % 1000 == 1:  # a line per thousand: a flood must not flood the log too
                log.warning("outcome_dropped_unacked", job_id=oldest[:128], dropped=self.dropped,
                            unacked=len(self.unacked), unacked_bytes=self.unacked_bytes)
            self._drop_unacked(oldest)
        self.unacked[job_id] = frame
        self._unacked_sizes[job_id] = size
        self.unacked_bytes += size
        self._forget(job_id)
        self._finished[job_id] = (frame, size)
        self._finished_bytes += size
        while len(self._finished) > MAX_FINISHED or self._finished_bytes > MAX_FINISHED_BYTES:
            self._forget(next(iter(self._finished)))
        return brief(frame)

    def _forget(self, job_id: str) -> None:
        kept = self._finished.pop(job_id, None)
        if kept is not None:
            self._finished_bytes -= kept[1]

    def ran(self, job_id: str) -> bool:
        """Whether this node has the job's outcome (one of its last MAX_FINISHED)."""
        return job_id in self._finished

    def ack(self, job_ids) -> None:
        for job_id in job_ids:
            self._drop_unacked(job_id)

    def _drop_unacked(self, job_id: str) -> None:
        if self.unacked.pop(job_id, None) is not None:
            self.unacked_bytes -= self._unacked_sizes.pop(job_id)

    def finished(self, job_id: str) -> pb.ProviderFrame | None:
        kept = self._finished.get(job_id)
        return kept[0] if kept else None
