"""Rank 0 rings before each step plan; the other ranks sleep until it does.

Between steps a follower waits for rank 0's next plan, and MLX's ring collective waits by polling: an idle
worker rank kept a whole core busy (99 %, measured on loopback) while rank 0 used 0.8 %. So on the ring each
follower holds a plain TCP connection to rank 0 and blocks in `recv` (no CPU) until rank 0 sends a byte, just
before it enters the collective that carries the plan. One byte a plan: a follower reads exactly one per plan.

A peer that is gone shows here first: rank 0's send fails, or a follower's read ends, and either raises
GroupLost. JACCL is left as it is (its wait is not measured here).
"""

from __future__ import annotations

import socket
import time

from .link import GroupLost, Link
from .spec import GroupSpec

RING = b"\x01"


class Doorbell:
    def __init__(self, peers: list[socket.socket]):
        self._peers = peers  # rank 0: one connection per follower; a follower: its connection to rank 0

    def ring(self) -> None:
        for conn in self._peers:
            try:
                conn.sendall(RING)
            except OSError as e:
                raise GroupLost(f"a rank of the group is gone (its wake-up connection: {e})") from None

    def wait(self) -> None:
        try:
            data = self._peers[0].recv(1)
        except OSError as e:
            raise GroupLost(f"rank 0 is gone (its wake-up connection: {e})") from None
        if not data:
            raise GroupLost("rank 0 is gone (it closed its wake-up connection)")


def open_doorbell(link: Link, spec: GroupSpec, timeout_s: float) -> Doorbell | None:
    """Connect every follower to rank 0 (a collective: every rank calls it, in the same place). None off the
    ring."""
    if spec.backend != "ring" or spec.size < 2:
        return None
    host = _host(spec.hosts[0][0])  # rank 0's first ring address: reachable by every rank
    if link.rank == 0:
        ranks = {_host(address) for addresses in spec.hosts[1:] for address in addresses}
        with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as server:
            link.share(server.getsockname()[1])
            peers = []
            deadline = time.monotonic() + timeout_s
            while len(peers) < spec.size - 1:
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    conn, (peer, *_) = server.accept()
                except TimeoutError:
                    raise GroupLost(f"{spec.size - 1 - len(peers)} rank(s) did not connect to rank 0's wake-up "
                                    f"port in {timeout_s:.0f} s") from None
                if peer not in ranks:  # not a rank of the hostfile: it would take a rank's place
                    conn.close()
                    continue
                peers.append(_tuned(conn))
        return Doorbell(peers)
    port = link.share()
    try:
        own = _host(spec.hosts[spec.rank][0])  # the address rank 0 accepts this rank from
        conn = socket.create_connection((host, port), timeout=timeout_s, source_address=(own, 0))
    except OSError as e:
        raise GroupLost(f"rank {spec.rank} could not reach rank 0's wake-up port {host}:{port}: {e}") from None
    conn.settimeout(None)
    return Doorbell([_tuned(conn)])


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def _tuned(conn: socket.socket) -> socket.socket:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a byte now, not batched with the next
    return conn
