"""The group's shared secret, and the MACs every rank proves itself and rank 0's plans with.

MLX's ring authenticates nothing, so anything the node itself sends between ranks (the rendezvous, the wake-up
connections, rank 0's plans) is bound to a secret only the group's machines hold: 32 random bytes, written by
`provider group init` to a file (0600) that is copied to every rank. Never in the hostfile, which is often
shared or generated. Each MAC also binds the hostfile's ranks and addresses and the purpose it is for, so a tag
made for one group, one message kind or one rank is worthless anywhere else."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from pathlib import Path

from .. import paths

SECRET_BYTES = 32
TAG_BYTES = 32  # HMAC-SHA256
DEFAULT_NAME = "group-secret"
_HEX = re.compile(rb"\s*([0-9a-f]{64})\s*")


class GroupSecretError(ValueError):
    """The secret is missing, readable by others or malformed: a message for the operator."""


def secret_path(configured: str) -> Path:
    return Path(configured).expanduser() if configured else paths.state_dir() / DEFAULT_NAME


def create_secret(path: Path, *, force: bool = False) -> None:
    """A new secret at `path` (0600); an existing one is kept unless `force`, since every rank must hold the same."""
    if path.exists() and not force:
        raise GroupSecretError(f"{path} exists already (every rank must hold the same secret: copy it to the "
                               f"others, or pass --force to make a new one and copy that)")
    paths.write_private(path, secrets.token_hex(SECRET_BYTES).encode() + b"\n")


def load_secret(path: Path) -> bytes:
    try:
        private = paths.is_private(path)
        raw = path.read_bytes()[:4096]
    except FileNotFoundError:
        raise GroupSecretError(f"no group secret at {path}: run `provider group init` on one machine and copy the "
                               f"file to every rank (or set group_secret_file / --group-secret)") from None
    except OSError as e:
        raise GroupSecretError(f"cannot read the group secret {path}: {e.strerror or e}") from None
    if not private:
        raise GroupSecretError(f"the group secret {path} can be read by other users: chmod 600 it")
    found = _HEX.fullmatch(raw)
    if found is None:
        raise GroupSecretError(f"the group secret {path} is not 64 lowercase hex digits (write one with "
                               f"`provider group init`)")
    return bytes.fromhex(found.group(1).decode())


class GroupKey:
    """MACs under the group's secret, bound to its hostfile's ranks and addresses."""

    def __init__(self, secret: bytes, hosts: tuple[tuple[str, ...], ...]):
        if len(secret) != SECRET_BYTES:
            raise GroupSecretError(f"a group secret is {SECRET_BYTES} bytes")
        self._secret = secret
        self.group_id = hashlib.sha256(json.dumps(hosts).encode()).digest()

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"GroupKey(group {self.group_id.hex()[:12]})"

    def tag(self, purpose: str, *parts: bytes | str | int) -> bytes:
        mac = hmac.new(self._secret, b"provider-group/1\0" + self.group_id + purpose.encode() + b"\0", hashlib.sha256)
        for part in parts:  # each part length-prefixed: no two lists of parts give the same bytes
            data = part if isinstance(part, bytes) else str(part).encode()
            mac.update(len(data).to_bytes(8, "little") + data)
        return mac.digest()

    def check(self, tag: bytes, purpose: str, *parts: bytes | str | int) -> bool:
        return hmac.compare_digest(tag, self.tag(purpose, *parts))
