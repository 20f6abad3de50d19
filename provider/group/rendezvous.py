"""Wait, with a limit, until every rank of a ring is up, before MLX's own init.

`mx.distributed.init` holds the interpreter's lock while it waits for its peers, and a ring rank waits for its
predecessor without end: no thread, timer or signal handler of ours runs until it returns. So the ranks meet
first here, in plain sockets on the addresses MLX will listen on, and a rank that never answers is named, with
its address, when the time runs out.

A barrier in two phases, so that no rank's MLX connects into a listener of ours that is still open:
1. each rank listens on its address and proves itself to every other rank over a connection of its own
   (provider.group.handshake: the listener's challenge, the dialer's hello under the group's secret);
2. once a rank has heard every other rank's proven hello, it closes its listener and answers each hello.
A rank is done when every rank has answered it (so every listener is closed) and every rank has hung up on
it. The side that connected hangs up first, so the listening port is left with no TIME_WAIT for MLX's bind.

Anyone can reach these ports: a connection that proves nothing is refused (logged, and told why), held at most
a few seconds, and never takes an honest rank's place.
"""

from __future__ import annotations

import selectors
import socket
import time

from .handshake import (Pending, Refused, answer_line, hello_line, new_nonce, read_answer, read_challenge,
                        read_hello, send_quietly, take_line, LINE_MAX)
from .spec import GroupSpec

PURPOSE = "rendezvous"
RETRY_S = 1.0  # before saying hello again to a rank that refused or hung up


class RendezvousError(RuntimeError):
    """Some ranks did not answer in time; the message names them."""


def _address(entry: str) -> tuple[str, int]:
    host, _, port = entry.rpartition(":")
    return host.strip("[]"), int(port)


class _Hello:
    """This rank's hello to one peer: its challenge first, then our proof, then its answer."""

    def __init__(self, peer: int):
        self.peer = peer
        self.nonce = new_nonce()
        self.buffer = bytearray()
        self.sent = False


def meet(spec: GroupSpec, timeout_s: float) -> None:
    """Return once every rank of `spec` has met this one; else RendezvousError naming those that did not."""
    host, port = _address(spec.hosts[spec.rank][0])
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise RendezvousError(f"rank {spec.rank} cannot listen on {host}:{port}: {e.strerror or e} (the hostfile's "
                              f"entry for rank {spec.rank} must be an address of this machine, on a free port)") from None
    listener.listen(64)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))
    pending = Pending(PURPOSE, sel)
    others = set(range(spec.size)) - {spec.rank}
    heard: dict[int, tuple[socket.socket, bytes]] = {}  # rank -> its proven hello's connection and nonce
    heard_from: set[int] = set()
    said: set[int] = set()  # ranks holding this rank's hello (its connection waits for their answer)
    answered: set[int] = set()
    refused_by: dict[int, str] = {}  # what a rank said when it refused this one's hello
    retry_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s

    def proven_hello(line: bytes, unproven) -> tuple[int, bytes]:
        return read_hello(line, spec.key, PURPOSE, spec.rank, range(spec.size), unproven.challenge)

    def hang_up(conn: socket.socket) -> None:
        sel.unregister(conn)
        conn.close()

    try:
        while answered != others or heard_from != others or heard:
            now = time.monotonic()
            for peer in sorted(others - said - answered):
                if retry_at.get(peer, 0.0) <= now:
                    conn = _dial(spec, peer, deadline)
                    if conn is None:
                        retry_at[peer] = now + 0.1
                        continue
                    said.add(peer)
                    sel.register(conn, selectors.EVENT_READ, ("out", _Hello(peer)))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(timeout=min(0.2, left)):
                kind, state = key.data
                conn = key.fileobj
                if kind == "listen":
                    pending.accept(listener)
                elif kind == "unproven":
                    proven = pending.read(conn, proven_hello)
                    if proven is not None:
                        rank, nonce = proven
                        if rank in heard:  # a restarted rank: its new connection replaces the old
                            hang_up(heard[rank][0])
                        heard[rank] = (conn, nonce)
                        heard_from.add(rank)
                        sel.modify(conn, selectors.EVENT_READ, ("heard", rank))
                elif kind == "heard":  # a proven rank hangs up: after our answer, or it died (it will come again)
                    if _recv(conn) != b"":
                        continue
                    hang_up(conn)
                    if heard.get(state, (None,))[0] is conn:
                        del heard[state]
                        if listener.fileno() >= 0:
                            heard_from.discard(state)
                else:  # "out": our hello to a peer
                    done = _step_hello(spec, conn, state)
                    if done is not None:
                        hang_up(conn)
                        said.discard(state.peer)
                        if done is True:
                            answered.add(state.peer)
                        else:
                            refused_by[state.peer] = done
                            retry_at[state.peer] = time.monotonic() + RETRY_S
            pending.expire()
            if listener.fileno() >= 0 and heard_from == others:
                sel.unregister(listener)
                listener.close()  # phase 2: nobody needs it now; answer every hello
                pending.close()
                for rank, (conn, nonce) in heard.items():
                    send_quietly(conn, answer_line(spec.key, PURPOSE, spec.rank, rank, nonce))
    finally:
        pending.close()
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
        listener.close()
    missing = sorted((others - answered) | (others - heard_from) | set(heard))
    if missing:
        named = ", ".join(f"rank {r} ({spec.hosts[r][0]})" + (f", which said: {refused_by[r]}" if r in refused_by
                                                              else "") for r in missing)
        raise RendezvousError(f"rank {spec.rank} did not hear from {named} within {timeout_s:g} s: start every rank "
                              f"with the same hostfile and group secret, and check that each address is that "
                              f"machine's and reachable from this one")


def _step_hello(spec: GroupSpec, conn: socket.socket, hello: _Hello) -> bool | str | None:
    """Read what the peer sent on our hello's connection: None while it goes on, True once the peer's proven
    answer came, else why it ended (a refusal, a hang-up, something that is not the group's)."""
    data = _recv(conn)
    if data is None:
        return None
    if not data:
        return "it hung up"
    try:
        line = take_line(hello.buffer, data)
        if line is None:
            return None
        del hello.buffer[:len(line)]
        if not hello.sent:
            challenge = read_challenge(line)
            hello.sent = send_quietly(conn, hello_line(spec.key, PURPOSE, spec.rank, hello.peer, challenge,
                                                       hello.nonce))
            return None if hello.sent else "it hung up"
        read_answer(line, spec.key, PURPOSE, hello.peer, spec.rank, hello.nonce)
        return True
    except Refused as e:
        return str(e)


def _dial(spec: GroupSpec, peer: int, deadline: float) -> socket.socket | None:
    """A connection to `peer`, or None if it is not listening (yet)."""
    host, port = _address(spec.hosts[peer][0])
    try:
        conn = socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic())))
    except OSError:
        return None
    conn.setblocking(False)
    return conn


def _recv(conn: socket.socket) -> bytes | None:
    """What came, b"" for a hang-up, None for a spurious wake-up."""
    try:
        return conn.recv(LINE_MAX)
    except BlockingIOError:
        return None
    except OSError:
        return b""
