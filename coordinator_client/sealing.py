"""Sealed jobs: a job body only the node can open, and chunks and completion only its sender can read.

The construction is in the proto, above `message Sealed`, and tests/vectors/sealing.json holds golden
values. The node's X25519 key lives in this process only: it is made at start, announced in the
Registration, and never written anywhere, so a sealed job cannot be opened after the process that
accepted it is gone. Pure functions over bytes, plus `SealingKey` for the node's side.
"""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .pb import provider_pb2 as pb

AAD_PREFIX = b"provider.v1.seal\0"
REQUEST_INFO = b"provider.v1.seal request"
RESPONSE_INFO = b"provider.v1.seal response"
DIGEST_INFO = b"provider.v1.seal digest"  # the key of a sealed run's token digest (HMAC-SHA256), sender and node only
COMPLETION_COUNTER = 2**64 - 1
PROOF_COUNTER = 2**64 - 2  # the outcome's proof, sealed apart from its completion (it goes out on the first send)
KEY_BYTES = 32
RUN_SALT_BYTES = 16  # drawn for every run of a sealed job: no (key, nonce) pair is ever used twice
SENDER_KEYS_REMEMBERED = 65_536  # ~6 MB; a key seen among the last this many is refused


class SealingError(Exception):
    """A sealed body did not open: wrong key, tampered bytes, or a malformed envelope."""


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def nonce(counter: int) -> bytes:
    return bytes(4) + counter.to_bytes(8, "big")


def aad(job_id: str, kind: str) -> bytes:
    return AAD_PREFIX + job_id.encode() + b"\0" + kind.encode()


def derive_keys(shared: bytes, sender_key: bytes, sealing_key: bytes, job_id: str,
                run_salt: bytes) -> tuple[bytes, bytes, bytes]:
    """The raw request key of one sealed job, and the response key and digest key of one run of it."""
    def hkdf(info: bytes) -> bytes:
        return HKDF(hashes.SHA256(), 32, sender_key + sealing_key, info).derive(shared)

    job, run = job_id.encode(), b"\0" + run_salt
    return (hkdf(REQUEST_INFO + b"\0" + job), hkdf(RESPONSE_INFO + b"\0" + job + run),
            hkdf(DIGEST_INFO + b"\0" + job + run))


@dataclass(frozen=True)
class JobKeys:
    """The keys of one run of a sealed job: sender -> node (`request`), node -> sender (`response`, fresh for
    every run: its `run_salt` is drawn by the node when it opens the job and sent in the clear), and the key of
    the run's token digest (`digest`), so the digest in the clear says nothing to anyone without the job's keys."""

    request: ChaCha20Poly1305
    response: ChaCha20Poly1305
    run_salt: bytes
    digest: bytes

    @classmethod
    def derive(cls, shared: bytes, sender_key: bytes, sealing_key: bytes, job_id: str,
               run_salt: bytes) -> "JobKeys":
        request, response, digest = derive_keys(shared, sender_key, sealing_key, job_id, run_salt)
        return cls(ChaCha20Poly1305(request), ChaCha20Poly1305(response), run_salt, digest)

    def seal_chunk(self, job_id: str, seq: int, body: pb.TokenChunk) -> bytes:
        """A chunk's body (its text, token ids, tool calls and logprobs; nothing else set) sealed as chunk `seq`."""
        return self.response.encrypt(nonce(seq), body.SerializeToString(), aad(job_id, "chunk"))

    def seal_completion(self, job_id: str, body: pb.Completion) -> bytes:
        return self.response.encrypt(nonce(COMPLETION_COUNTER), body.SerializeToString(), aad(job_id, "completion"))

    def seal_proof(self, job_id: str, body: pb.Proof) -> bytes:
        return self.response.encrypt(nonce(PROOF_COUNTER), body.SerializeToString(deterministic=True),
                                     aad(job_id, "proof"))

    # The sender's side (the reference coordinator and tests use these, through SenderKeys.for_run).
    def open_chunk(self, job_id: str, seq: int, sealed: bytes) -> pb.TokenChunk:
        return pb.TokenChunk.FromString(self._open(self.response, nonce(seq), sealed, aad(job_id, "chunk")))

    def open_completion(self, job_id: str, sealed: bytes) -> pb.Completion:
        return pb.Completion.FromString(
            self._open(self.response, nonce(COMPLETION_COUNTER), sealed, aad(job_id, "completion")))

    def open_proof(self, job_id: str, sealed: bytes) -> pb.Proof:
        return pb.Proof.FromString(self._open(self.response, nonce(PROOF_COUNTER), sealed, aad(job_id, "proof")))

    @staticmethod
    def _open(aead: ChaCha20Poly1305, n: bytes, sealed: bytes, associated: bytes) -> bytes:
        try:
            return aead.decrypt(n, sealed, associated)
        except InvalidTag:
            raise SealingError("the sealed bytes do not open with this job's key (tampered or wrong key)") from None


@dataclass(frozen=True)
class SenderKeys:
    """The sender's side of one sealed job: what it needs to open the answers of each run of it."""

    shared: bytes
    sender_key: bytes
    sealing_key: bytes
    job_id: str

    def for_run(self, run_salt: bytes) -> JobKeys:
        """The keys of the run that announced `run_salt` (JobAccepted.seal_salt, Completion.seal_salt)."""
        return JobKeys.derive(self.shared, self.sender_key, self.sealing_key, self.job_id, run_salt)


def seal_job(sealing_key: bytes, job_id: str, body: pb.JobRequest,
             sender: X25519PrivateKey | None = None) -> tuple[pb.Sealed, SenderKeys]:
    """The sender's side: seal `body` for the node whose Registration.sealing_key is `sealing_key`. Use a
    fresh `sender` for every job: the node refuses a sender key it has seen."""
    sender = sender or X25519PrivateKey.generate()
    sender_key = _raw(sender.public_key())
    keys = SenderKeys(sender.exchange(X25519PublicKey.from_public_bytes(sealing_key)), sender_key, sealing_key,
                      job_id)
    request = ChaCha20Poly1305(derive_keys(keys.shared, sender_key, sealing_key, job_id, b"")[0])
    ciphertext = request.encrypt(nonce(0), body.SerializeToString(), aad(job_id, "job"))
    return pb.Sealed(sender_key=sender_key, ciphertext=ciphertext), keys


class SealingKey:
    """The node's per-process X25519 key."""

    def __init__(self, key: X25519PrivateKey | None = None, remember: int = SENDER_KEYS_REMEMBERED):
        self._key = key or X25519PrivateKey.generate()
        self.public_key = _raw(self._key.public_key())
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # sender keys, oldest first
        self._remember = remember

    def open_job(self, job_id: str, sealed: pb.Sealed, run_salt: bytes | None = None) -> tuple[pb.JobRequest, JobKeys]:
        """The plaintext JobRequest and the keys of this run of it (a fresh `run_salt` unless given: golden
        vectors give one); SealingError if it does not open, or its sender key was used before."""
        if len(sealed.sender_key) != KEY_BYTES:
            raise SealingError(f"sealed.sender_key must be {KEY_BYTES} bytes, got {len(sealed.sender_key)}")
        if sealed.sender_key in self._seen:
            raise SealingError("this sender key was used for another sealed job (or this one, already run); seal "
                               "every job with a fresh ephemeral key")
        try:
            shared = self._key.exchange(X25519PublicKey.from_public_bytes(sealed.sender_key))
        except ValueError as e:  # a low-order point gives an all-zero secret, which cryptography refuses
            raise SealingError(f"sealed.sender_key is not a usable X25519 key: {e}") from None
        keys = JobKeys.derive(shared, sealed.sender_key, self.public_key, job_id,
                              secrets.token_bytes(RUN_SALT_BYTES) if run_salt is None else run_salt)
        plaintext = keys._open(keys.request, nonce(0), sealed.ciphertext, aad(job_id, "job"))
        try:
            body = pb.JobRequest.FromString(plaintext)
        except Exception:
            raise SealingError("the sealed body opened but is not a serialized JobRequest") from None
        self._seen[sealed.sender_key] = None
        if len(self._seen) > self._remember:  # bounded: past it, the run salt alone keeps every key fresh
            self._seen.popitem(last=False)
        return body, keys


SEALED_CHUNK_BUCKET = 256  # a sealed body's length is rounded up to this: "Yes" and "No" seal alike


def padded(body, bucket: int = SEALED_CHUNK_BUCKET):
    """A copy of `body` (a TokenChunk or a Completion) whose serialized size is a multiple of `bucket` (its
    `padding` field's zeros)."""
    out = type(body)()
    out.CopyFrom(body)
    size = out.ByteSize()
    target = -(-(size + 3) // bucket) * bucket  # room for the field's tag and length
    for overhead in (2, 3, 4):  # the length's varint grows with it
        out.padding = bytes(max(0, target - size - overhead))
        if out.ByteSize() == target:
            break
    return out
