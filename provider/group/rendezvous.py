"""Wait, with a limit, until every rank of a ring is up, before MLX's own init.

`mx.distributed.init` holds the interpreter's lock while it waits for its peers, and a ring rank waits for its
predecessor without end: no thread, timer or signal handler of ours runs until it returns. So the ranks meet
first here, in plain sockets on the addresses MLX will listen on, and a rank that never answers is named, with
its address, when the time runs out.

A barrier in two phases, so that no rank's MLX connects into a listener of ours that is still open:
1. each rank listens on its address and says hello to every other rank over a connection of its own;
2. once a rank has heard every other rank's hello, it closes its listener and answers each hello with "k".
A rank is done when every rank has answered it (so every listener is closed) and every rank has hung up on
it. The side that connected hangs up first, so the listening port is left with no TIME_WAIT for MLX's bind.
"""

from __future__ import annotations

import selectors
import socket
import time

from .spec import GroupSpec

HELLO = b"provider-group/1 "
ANSWER = b"k"


class RendezvousError(RuntimeError):
    """Some ranks did not answer in time; the message names them."""


def _address(entry: str) -> tuple[str, int]:
    host, _, port = entry.rpartition(":")
    return host.strip("[]"), int(port)


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
    listener.listen(spec.size)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))
    others = set(range(spec.size)) - {spec.rank}
    heard: dict[int, socket.socket] = {}  # rank -> its hello's connection, until it hangs up
    heard_from: set[int] = set()
    said: set[int] = set()  # ranks holding this rank's hello (its connection waits for their answer)
    answered: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while answered != others or heard_from != others or heard:
            for peer in sorted(others - said - answered):
                conn = _hello(spec, peer, deadline)
                if conn is not None:
                    said.add(peer)
                    sel.register(conn, selectors.EVENT_READ, ("out", peer))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(timeout=min(0.2, left)):
                kind, state = key.data
                if kind == "listen":
                    conn, _ = listener.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, ("in", bytearray()))
                    continue
                data = _recv(key.fileobj)
                if data is None:
                    continue
                if kind == "in" and data and len(state) < 64:  # a hello coming in
                    state += data
                    rank = _hello_rank(bytes(state), spec.size)
                    if rank is not None:
                        heard[rank] = key.fileobj
                        heard_from.add(rank)
                    continue
                # An answer to our hello, or a hang-up: after our answer (phase 2), or a rank that died before
                # its hello or our answer (it will say hello again when restarted).
                sel.unregister(key.fileobj)
                key.fileobj.close()
                if kind == "out":
                    said.discard(state)
                    if data == ANSWER:
                        answered.add(state)
                else:
                    gone = [r for r, c in heard.items() if c is key.fileobj]
                    for r in gone:
                        del heard[r]
                        if listener.fileno() >= 0:
                            heard_from.discard(r)
            if listener.fileno() >= 0 and heard_from == others:
                sel.unregister(listener)
                listener.close()  # phase 2: nobody needs it now; answer every hello
                for conn in heard.values():
                    try:
                        conn.sendall(ANSWER)
                    except OSError:
                        pass
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
        listener.close()
    missing = sorted((others - answered) | (others - heard_from) | set(heard))
    if missing:
        named = ", ".join(f"rank {r} ({spec.hosts[r][0]})" for r in missing)
        raise RendezvousError(f"rank {spec.rank} did not hear from {named} within {timeout_s:g} s: start every rank "
                              f"with the same hostfile, and check that each address is that machine's and reachable "
                              f"from this one")


def _hello(spec: GroupSpec, peer: int, deadline: float) -> socket.socket | None:
    """A connection to `peer` carrying this rank's hello, or None if it is not listening (yet)."""
    host, port = _address(spec.hosts[peer][0])
    try:
        conn = socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic())))
    except OSError:
        return None
    try:
        conn.sendall(HELLO + str(spec.rank).encode() + b"\n")
    except OSError:
        conn.close()
        return None
    conn.setblocking(False)
    return conn


def _hello_rank(buffer: bytes, size: int) -> int | None:
    if not (buffer.startswith(HELLO) and buffer.endswith(b"\n")):
        return None
    rank = buffer[len(HELLO):-1].decode(errors="replace")
    return int(rank) if rank.isdigit() and int(rank) < size else None


def _recv(conn: socket.socket) -> bytes | None:
    """What came, b"" for a hang-up, None for a spurious wake-up."""
    try:
        return conn.recv(64)
    except BlockingIOError:
        return None
    except OSError:
        return b""
