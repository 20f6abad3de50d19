"""Rank 0 rings before each step plan; the other ranks sleep until it does.

Between steps a follower waits for rank 0's next plan, and MLX's ring collective waits by polling: an idle
worker rank kept a whole core busy (99 %, measured on loopback) while rank 0 used 0.8 %. So on the ring each
follower holds a plain TCP connection to rank 0 and blocks in `recv` (no CPU) until rank 0 sends a byte, just
before it enters the collective that carries the plan. One byte a plan: a follower reads exactly one per plan.

Anyone can reach rank 0's wake-up port, so a follower proves its rank on connecting (provider.group.handshake,
under the group's secret, from its own hostfile address) and each rank's place is taken once; rank 0 proves
itself back. A peer that is gone shows here first: rank 0's send fails, or a follower's read ends, and either raises
GroupLost. JACCL is left as it is (its wait is not measured here).
"""

from __future__ import annotations

import selectors
import socket
import time

from ..engine.collective import GroupLost
from .handshake import Pending, Refused, answer_line, hello_line, new_nonce, read_answer, read_challenge, read_hello, \
    send_quietly, LINE_MAX
from .link import Link
from .spec import GroupSpec

RING = b"\x01"
PURPOSE = "wake-up"


class Doorbell:
    def __init__(self, peers: list[socket.socket]):
        self._peers = peers  # rank 0: one connection per follower; a follower: its connection to rank 0

    def ring(self) -> None:
        for conn in self._peers:
            try:
                conn.sendall(RING)  # under the connection's timeout: a rank that stops reading is a rank lost
            except OSError as e:
                raise GroupLost(f"a rank of the group is gone (its wake-up connection: {e or 'timed out'})") from None

    def wait(self) -> None:
        try:
            data = self._peers[0].recv(1)
        except OSError as e:
            raise GroupLost(f"rank 0 is gone (its wake-up connection: {e})") from None
        if not data:
            raise GroupLost("rank 0 is gone (it closed its wake-up connection)")


def open_doorbell(link: Link, spec: GroupSpec, timeout_s: float, send_timeout_s: float) -> Doorbell | None:
    """Connect every follower to rank 0, each proving its rank (a collective: every rank calls it, in the same
    place). None off the ring. Rank 0's rings give up after `send_timeout_s` on a rank that stopped reading."""
    if spec.backend != "ring" or spec.size < 2:
        return None
    host = _host(spec.hosts[0][0])  # rank 0's first ring address: reachable by every rank
    if link.rank == 0:
        with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as server:
            link.share_port(server.getsockname()[1])
            peers = accept_followers(server, spec, time.monotonic() + timeout_s)
        for conn in peers:
            conn.settimeout(send_timeout_s)
        return Doorbell(peers)
    port = link.share_port()
    return Doorbell([dial_leader(spec, host, port, timeout_s)])


def accept_followers(server: socket.socket, spec: GroupSpec, deadline: float) -> list[socket.socket]:
    """Rank 0: one proven connection from each follower, by rank. Anyone may connect; only a rank's proof under
    the group's secret, from that rank's hostfile address, takes its place, and each place is taken once."""
    server.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ, ("listen", None))
    pending = Pending(PURPOSE, sel)
    peers: dict[int, socket.socket] = {}

    def proof(line: bytes, unproven) -> tuple[int, bytes]:
        rank, nonce = read_hello(line, spec.key, PURPOSE, 0, range(1, spec.size), unproven.challenge)
        if rank in peers:
            raise Refused(f"rank {rank} is connected already")
        if unproven.address.rpartition(":")[0] not in {_host(a) for a in spec.hosts[rank]}:
            raise Refused(f"rank {rank} connects from its own hostfile address, not {unproven.address}")
        return rank, nonce

    try:
        while len(peers) < spec.size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, spec.size)) - set(peers))
                raise GroupLost(f"rank(s) {', '.join(map(str, missing))} did not connect to rank 0's wake-up port "
                                f"in time")
            for key, _ in sel.select(timeout=min(0.2, left)):
                if key.data[0] == "listen":
                    pending.accept(server)
                    continue
                proven = pending.read(key.fileobj, proof)
                if proven is not None:
                    rank, nonce = proven
                    conn = key.fileobj
                    sel.unregister(conn)
                    conn.setblocking(True)
                    if send_quietly(conn, answer_line(spec.key, PURPOSE, 0, rank, nonce)):
                        peers[rank] = _tuned(conn)
                    else:
                        conn.close()
            pending.expire()
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    finally:
        pending.close()
        sel.close()
    return [peers[r] for r in sorted(peers)]


def dial_leader(spec: GroupSpec, host: str, port: int, timeout_s: float) -> socket.socket:
    """A follower: its proven connection to rank 0's wake-up port, from its own hostfile address."""
    own = _host(spec.hosts[spec.rank][0])  # the address rank 0 accepts this rank from
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s, source_address=(own, 0))
    except OSError as e:
        raise GroupLost(f"rank {spec.rank} could not reach rank 0's wake-up port {host}:{port}: {e}") from None
    try:
        challenge = read_challenge(_line(conn))
        nonce = new_nonce()
        conn.sendall(hello_line(spec.key, PURPOSE, spec.rank, 0, challenge, nonce))
        read_answer(_line(conn), spec.key, PURPOSE, 0, spec.rank, nonce)
    except (OSError, Refused) as e:
        conn.close()
        raise GroupLost(f"rank {spec.rank} could not prove itself on rank 0's wake-up port {host}:{port}: "
                        f"{e}") from None
    conn.settimeout(None)
    return _tuned(conn)


def _line(conn: socket.socket) -> bytes:
    """One line, read a byte at a time: what follows it (rank 0's first ring) stays in the socket."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            raise Refused("rank 0's side hung up")
        line += byte
        if len(line) > LINE_MAX:
            raise Refused("a line too long")
    return bytes(line)


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def _tuned(conn: socket.socket) -> socket.socket:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a byte now, not batched with the next
    return conn
