"""How a rank proves it is one, on the plain sockets the node opens between ranks (the rendezvous and the
wake-up connections): a challenge–response under the group's secret, one line each way.

    listener -> "provider-group/2 challenge <32 hex>\\n"             a fresh nonce per connection
    dialer   -> "provider-group/2 <rank> <32 hex> <64 hex>\\n"        its rank, its own nonce, the MAC of both
                                                                     nonces, both ranks and the purpose
    listener -> "k <64 hex>\\n"  or  "no <reason>\\n"                 the MAC of the dialer's nonce: the
                                                                     listener holds the secret too

Everything before the proof is hostile: lines are bounded, parsed by exact patterns (ASCII digits only), and an
unproven connection has a few seconds and a bounded number of places (`Pending`) before it is dropped.
"""

from __future__ import annotations

import re
import secrets
import selectors
import socket
import time
from dataclasses import dataclass, field

from .. import logs
from .secret import GroupKey

VERSION = b"provider-group/2"
NONCE_BYTES = 16
LINE_MAX = 160  # the longest line above is 117 bytes
PROOF_TIMEOUT_S = 5.0  # an unproven connection's time to say who it is
MAX_PENDING = 32  # unproven connections held at once; a new one pushes out the oldest
LOGGED_REFUSALS = 10  # refusals logged one by one in a rendezvous or wake-up set-up; the rest are counted

_CHALLENGE = re.compile(rb"provider-group/2 challenge ([0-9a-f]{32})\n")
_HELLO = re.compile(rb"provider-group/2 ([0-9]{1,2}) ([0-9a-f]{32}) ([0-9a-f]{64})\n")
_ANSWER = re.compile(rb"k ([0-9a-f]{64})\n")
_REFUSAL = re.compile(rb"no ([ -~]{1,120})\n")

log = logs.get("group")


class Refused(Exception):
    """What a peer said or did that proves nothing: the reason, for the log and for the peer."""


def challenge_line(nonce: bytes) -> bytes:
    return VERSION + b" challenge " + nonce.hex().encode() + b"\n"


def read_challenge(line: bytes) -> bytes:
    found = _CHALLENGE.fullmatch(line)
    if found is None:
        raise Refused(_refusal_text(line) or "not a provider group's challenge")
    return bytes.fromhex(found.group(1).decode())


def hello_line(key: GroupKey, purpose: str, rank: int, peer: int, challenge: bytes, nonce: bytes) -> bytes:
    tag = key.tag(purpose + "/hello", rank, peer, challenge, nonce)
    return b"%s %d %s %s\n" % (VERSION, rank, nonce.hex().encode(), tag.hex().encode())


def read_hello(line: bytes, key: GroupKey, purpose: str, own_rank: int, ranks: range, challenge: bytes
               ) -> tuple[int, bytes]:
    """The proven rank of the dialer and its nonce; Refused for anything else."""
    found = _HELLO.fullmatch(line)
    if found is None:
        raise Refused("malformed hello" if line.startswith(VERSION) else "not a provider group's hello")
    rank, nonce, tag = int(found.group(1)), bytes.fromhex(found.group(2).decode()), bytes.fromhex(found.group(3).decode())
    if rank not in ranks or rank == own_rank:
        raise Refused(f"rank {rank} cannot say hello to rank {own_rank} here")
    if not key.check(tag, purpose + "/hello", rank, own_rank, challenge, nonce):
        raise Refused(f"hello as rank {rank} not proven: a different group secret or hostfile")
    return rank, nonce


def answer_line(key: GroupKey, purpose: str, own_rank: int, peer: int, nonce: bytes) -> bytes:
    return b"k " + key.tag(purpose + "/answer", own_rank, peer, nonce).hex().encode() + b"\n"


def read_answer(line: bytes, key: GroupKey, purpose: str, peer: int, own_rank: int, nonce: bytes) -> None:
    found = _ANSWER.fullmatch(line)
    if found is None:
        raise Refused(_refusal_text(line) or "not a provider group's answer")
    if not key.check(bytes.fromhex(found.group(1).decode()), purpose + "/answer", peer, own_rank, nonce):
        raise Refused(f"an answer as rank {peer} not proven: a different group secret or hostfile")


def refusal_line(reason: str) -> bytes:
    return b"no " + reason.encode("ascii", "replace")[:120] + b"\n"


def _refusal_text(line: bytes) -> str | None:
    found = _REFUSAL.fullmatch(line)
    return f"refused: {found.group(1).decode()}" if found else None


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def take_line(buffer: bytearray, data: bytes) -> bytes | None:
    """Append `data`; the first whole line once there is one. Refused once the buffer passes LINE_MAX."""
    buffer += data
    end = buffer.find(b"\n")
    if end < 0:
        if len(buffer) > LINE_MAX:
            raise Refused("a line too long")
        return None
    return bytes(buffer[:end + 1])


def send_quietly(conn: socket.socket, data: bytes) -> bool:
    """Send a short line on a connection that may be gone; whether it went."""
    try:
        conn.sendall(data)
        return True
    except OSError:
        return False


@dataclass
class Unproven:
    address: str
    challenge: bytes
    deadline: float
    buffer: bytearray = field(default_factory=bytearray)


class Pending:
    """Connections accepted but not yet proven: each gets a challenge at once and PROOF_TIMEOUT_S to answer it;
    at most MAX_PENDING are held (a new one pushes out the oldest), so a flood or connections held open cost a
    bounded number of descriptors and never the honest ranks' places for long."""

    def __init__(self, what: str, sel: selectors.BaseSelector):
        self.what = what  # for the log: "rendezvous" or "wake-up"
        self.sel = sel  # each connection is registered here with ("unproven", None) while it is held
        self.conns: dict[socket.socket, Unproven] = {}
        self.refusals = 0

    def accept(self, listener: socket.socket) -> socket.socket | None:
        try:
            conn, peer = listener.accept()
        except BlockingIOError:
            return None
        except OSError as e:  # out of descriptors, or the peer reset before we took it: drop the oldest, go on
            self.refuse(None, f"accept failed: {e.strerror or e}")
            if self.conns:
                self.drop(next(iter(self.conns)))
            else:
                time.sleep(0.05)
            return None
        if len(self.conns) >= MAX_PENDING:
            self.refuse(next(iter(self.conns)), "too many unproven connections")
        conn.setblocking(False)
        challenge = new_nonce()
        if not send_quietly(conn, challenge_line(challenge)):
            conn.close()
            return None
        self.conns[conn] = Unproven(f"{peer[0]}:{peer[1]}", challenge, time.monotonic() + PROOF_TIMEOUT_S)
        self.sel.register(conn, selectors.EVENT_READ, ("unproven", None))
        return conn

    def read(self, conn: socket.socket, proof) -> object | None:
        """Feed what `conn` sent to `proof(line, unproven)`, once a line is whole; its result once proven (the
        connection is then the caller's, still registered: `sel.modify` it). A refusal or a hang-up drops it."""
        unproven = self.conns[conn]
        try:
            data = conn.recv(LINE_MAX)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            self.drop(conn)
            return None
        try:
            line = take_line(unproven.buffer, data)
            if line is None:
                return None
            proven = proof(line, unproven)
        except Refused as e:
            self.refuse(conn, str(e))
            return None
        del self.conns[conn]
        return proven

    def expire(self) -> None:
        """Drop the connections whose time is up."""
        now = time.monotonic()
        for conn in [c for c, u in self.conns.items() if u.deadline < now]:
            self.refuse(conn, f"no proof within {PROOF_TIMEOUT_S:g} s")

    def refuse(self, conn: socket.socket | None, reason: str) -> None:
        """Log the refusal (the first few one by one), tell the peer why, and close its connection."""
        self.refusals += 1
        address = self.conns[conn].address if conn in self.conns else "?"
        if self.refusals <= LOGGED_REFUSALS:
            log.warning("group_connection_refused", on=self.what, peer=address, reason=reason)
        if conn is not None:
            send_quietly(conn, refusal_line(reason))
            self.drop(conn)

    def drop(self, conn: socket.socket) -> None:
        self.conns.pop(conn, None)
        self.sel.unregister(conn)
        conn.close()

    def close(self) -> None:
        for conn in list(self.conns):
            self.drop(conn)
        if self.refusals > LOGGED_REFUSALS:  # once: the count of those not logged one by one
            log.warning("group_connections_refused", on=self.what, count=self.refusals, logged=LOGGED_REFUSALS)
            self.refusals = LOGGED_REFUSALS
