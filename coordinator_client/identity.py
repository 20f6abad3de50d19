"""The node's Ed25519 identity, the signed registration envelope, and a coordinator's check of it."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from provider import paths

from .pb import provider_pb2 as pb

SIGNING_DOMAIN = b"provider.v1.registration\0"
KEY_FILE = "identity.ed25519.pem"
EPOCH_FILE = "session_epoch"
MAX_SKEW_MS = 60_000  # a registration's clock may be this far from the coordinator's


class IdentityError(Exception):
    """The key file is unsafe or unreadable; the node refuses to start."""


def node_id_for(public_key: bytes) -> str:
    return "node-" + hashlib.sha256(public_key).hexdigest()[:24]


class Identity:
    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public_key = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.node_id = node_id_for(self.public_key)

    @classmethod
    def load_or_create(cls, state_dir: Path | None = None) -> "Identity":
        path = (state_dir or paths.state_dir()) / KEY_FILE
        if not path.exists():
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
            paths.write_private(path, pem)
            return cls(key)
        if not paths.is_private(path):
            raise IdentityError(f"{path} is readable or writable by other users (mode "
                                f"{path.stat().st_mode & 0o777:o}); run `chmod 600 {path}`")
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise IdentityError(f"{path} is not a PEM Ed25519 private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def hello(self, registration: pb.Registration) -> pb.Hello:
        body = registration.SerializeToString()
        return pb.Hello(registration=body, signature=self.sign(SIGNING_DOMAIN + body))


def verify_hello(hello: pb.Hello) -> pb.Registration:
    """Check the envelope's signature with the key it names; raise InvalidSignature or ValueError."""
    reg = pb.Registration.FromString(hello.registration)
    if len(reg.public_key) != 32:
        raise ValueError("public_key must be 32 bytes")
    if reg.node_id != node_id_for(reg.public_key):
        raise ValueError("node_id does not match public_key")
    Ed25519PublicKey.from_public_bytes(reg.public_key).verify(hello.signature, SIGNING_DOMAIN + hello.registration)
    return reg


def admit_hello(frame: pb.ProviderFrame, nonce: bytes, issued: set[bytes], epochs: dict[str, int]
                ) -> pb.Registration | str:
    """A coordinator's check of a node's first frame: its registration, or why it is refused. The nonce must be
    one `issued` and not yet used (it is used up here), the clock within MAX_SKEW_MS, and the session epoch newer
    than the node's last one in `epochs` (recorded here)."""
    if frame.WhichOneof("frame") != "hello":
        return "expected hello"
    try:
        reg = verify_hello(frame.hello)
    except InvalidSignature:
        return "bad signature"
    except Exception as e:  # unparseable registration, wrong key size, node id not derived from the key
        return f"bad registration: {e}"
    if reg.nonce != nonce or nonce not in issued:
        return "stale or foreign nonce"
    issued.discard(nonce)
    if abs(reg.timestamp_ms - time.time() * 1000) > MAX_SKEW_MS:
        return "timestamp outside the allowed clock skew"
    if reg.session_epoch <= epochs.get(reg.node_id, 0):
        return "session epoch is not newer than the current one"
    epochs[reg.node_id] = reg.session_epoch
    return reg


def next_session_epoch(state_dir: Path | None = None) -> int:
    """A counter that grows with every connect, across restarts, so a rejoin outranks any ghost session."""
    path = (state_dir or paths.state_dir()) / EPOCH_FILE
    try:
        current = int(path.read_text().strip())
    except (OSError, ValueError):
        current = 0
    paths.write_private(path, str(current + 1).encode())
    return current + 1


__all__ = ["Identity", "IdentityError", "InvalidSignature", "verify_hello", "next_session_epoch", "node_id_for"]
