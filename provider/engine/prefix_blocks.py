"""Prompts addressed by a chain of block hashes over their token ids: block i's hash covers the scope and every
token before the end of block i, so two prompts share block i's hash exactly when they share the scope and
their first (i + 1) * BLOCK tokens. Pure: what the disk tier indexes by, and what routing can compare without
seeing a prompt.

The scope is the model's manifest hash and the tenant that may reuse the prefix: a prefix stored under one
scope is never found under another.
"""

from __future__ import annotations

import hashlib
from array import array

BLOCK = 256  # tokens a block: small enough that a shared system prompt is found, large enough for few files


def scope_of(model_hash: str, tenant: str) -> bytes:
    return hashlib.sha256(b"provider.prefix-scope\0" + model_hash.encode() + b"\0" + tenant.encode()).digest()


def chain(scope: bytes, tokens: list[int] | tuple[int, ...]) -> list[bytes]:
    """The hash of each full block of `tokens` (a partial last block has none)."""
    out, h = [], scope
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hashlib.sha256(h + array("I", tokens[start:start + BLOCK]).tobytes()).digest()
        out.append(h)
    return out


def entry_key(scope: bytes, tokens: list[int] | tuple[int, ...], blocks: list[bytes] | None = None) -> str:
    """The name of a stored entry of exactly `tokens`: its last block's hash and the tokens after it."""
    blocks = chain(scope, tokens) if blocks is None else blocks
    head = blocks[-1] if blocks else scope
    tail = array("I", tokens[len(blocks) * BLOCK:]).tobytes()
    return hashlib.sha256(head + len(tokens).to_bytes(8, "little") + tail).hexdigest()
