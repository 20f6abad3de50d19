"""`provider group check HOSTFILE --rank R`: before a group serves, whether its ranks reach each other and how
fast, measured through MLX's own backend (the links the model's collectives will use), each phase under a
timeout so a missing or silent rank is named instead of waited for.

Every rank runs the same command. Rank 0 prints the report; every rank prints what it sees of its own links.
The ring backend connects each rank to its neighbours only, so the links measured are rank r to rank r+1.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

from ..engine.collective import GroupLost
from .link import join
from .spec import GroupSpec, public_addresses

PING_ROUNDS = 20
BANDWIDTH_ROUNDS = 3
FACTS_BYTES = 256  # each rank's description, padded, in one all_gather


@dataclass(frozen=True)
class LinkFigures:
    src: int
    dst: int
    latency_ms_p50: float  # one round trip of a 4-byte array
    latency_ms_max: float
    bandwidth_gb_s: float  # payload one way, best of BANDWIDTH_ROUNDS


@dataclass(frozen=True)
class Report:
    ranks: int
    backend: str
    join_s: float
    facts: tuple[str, ...]  # per rank: host, MLX version, memory
    links: tuple[LinkFigures, ...]
    all_sum_ms: float  # the payload summed across every rank (what a tensor-parallel layer does twice)
    payload_bytes: int
    problems: tuple[str, ...]

    def as_dict(self) -> dict:
        return asdict(self)


def network_problems(spec: GroupSpec) -> list[str]:
    public = public_addresses(spec.hosts)
    return [f"public addresses in the hostfile ({', '.join(public)}): MLX's ring carries tensors unauthenticated and "
            f"in plaintext, so the group's links must be a private network (provider start refuses them without "
            f"--group-public-network)"] if public else []


def ring_links(size: int) -> list[tuple[int, int]]:
    """The neighbour links of a ring of `size` ranks (a ring of two has one link)."""
    return [(0, 1)] if size == 2 else [(r, (r + 1) % size) for r in range(size)]


def run_check(spec: GroupSpec, timeout_s: float, payload_bytes: int) -> Report:
    """Join, then measure; every phase under `timeout_s`. Raises GroupLost naming what did not answer (a rank
    stuck in a collective cannot be interrupted: the caller exits the process)."""
    start = time.monotonic()
    group = join(spec, timeout_s)
    join_s = time.monotonic() - start
    before, after = (spec.rank - 1) % spec.size, (spec.rank + 1) % spec.size
    return _within(timeout_s, f"rank {spec.rank} joined, but the measurements did not finish: a rank stopped "
                   f"answering (this rank's neighbours are ranks {before} and {after})",
                   lambda: _measure(spec, group, join_s, payload_bytes))


def _within(timeout_s: float, why: str, work: Callable[[], Report]) -> Report:
    result: dict = {}

    def run() -> None:
        try:
            result["report"] = work()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, name="group-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise GroupLost(f"{why} within {timeout_s:g} s")
    if "error" in result:
        raise GroupLost(f"{why}: {result['error']}")
    return result["report"]


def _measure(spec: GroupSpec, group, join_s: float, payload_bytes: int) -> Report:
    import mlx.core as mx

    rank, size = group.rank(), group.size()
    gathered = _gather_facts(group)
    facts = tuple(f"{f.get('host')}: mlx {f.get('mlx')}, {f.get('memory_gib')} GiB, {f.get('platform')}, pid "
                  f"{f.get('pid')}" for f in gathered)
    links = ring_links(size)
    figures = mx.zeros((len(links), 3))  # each link's sender fills its row; an all_sum gives every rank all rows
    for i, (src, dst) in enumerate(links):
        if rank in (src, dst):
            row = _measure_link(group, src, dst, payload_bytes)
            if rank == src:
                figures[i] = mx.array(row)
        _barrier(group)
    figures = mx.distributed.all_sum(figures, group=group)
    payload = mx.ones((payload_bytes // 4,), dtype=mx.float32)
    mx.eval(mx.distributed.all_sum(payload, group=group))  # connections warm
    t = time.perf_counter()
    mx.eval(mx.distributed.all_sum(payload, group=group))
    all_sum_ms = (time.perf_counter() - t) * 1e3
    link_figures = tuple(LinkFigures(s, d, *(round(float(v), 3) for v in figures[i].tolist()))
                         for i, (s, d) in enumerate(links))
    versions = {f.get("mlx", "?") for f in gathered}
    problems = tuple(network_problems(spec)) + ((f"the ranks run different MLX versions "
                                                 f"({', '.join(sorted(versions))}): their tokens may differ",)
                                                if len(versions) > 1 else ())
    return Report(size, spec.backend, round(join_s, 3), facts, link_figures, round(all_sum_ms, 3), payload_bytes,
                  problems)


def _measure_link(group, src: int, dst: int, payload_bytes: int) -> list[float]:
    """Round trips of a tiny array, then the payload sent one way and acknowledged; src times both."""
    import mlx.core as mx

    tiny = mx.zeros((1,), dtype=mx.float32)
    trips = [_exchange(group, src, dst, tiny, tiny) for _ in range(PING_ROUNDS + 1)][1:]  # the first sets up
    payload = mx.ones((payload_bytes // 4,), dtype=mx.float32)
    mx.eval(payload)
    best = min(_exchange(group, src, dst, payload, tiny) for _ in range(BANDWIDTH_ROUNDS))
    return [statistics.median(trips) * 1e3, max(trips) * 1e3, payload_bytes / best / 1e9]


def _exchange(group, src: int, dst: int, out, back) -> float:
    """`src` sends `out` to `dst`, which answers with `back`; the seconds it took."""
    import mlx.core as mx

    t = time.perf_counter()
    if group.rank() == src:
        mx.eval(mx.distributed.send(out, dst, group=group))
        mx.eval(mx.distributed.recv_like(back, dst, group=group))
    else:
        mx.eval(mx.distributed.recv_like(out, src, group=group))
        mx.eval(mx.distributed.send(back, src, group=group))
    return time.perf_counter() - t


def _barrier(group) -> None:
    import mlx.core as mx

    mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group))


def _gather_facts(group) -> list[dict]:
    """Every rank's host, MLX version, memory and platform, by rank (JSON, padded, in one all_gather)."""
    import json

    import mlx.core as mx
    import psutil

    mine = json.dumps({"host": platform.node() or "?", "mlx": mx.__version__,
                       "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                       "platform": f"{platform.system()} {platform.machine()}", "pid": os.getpid()}).encode()
    padded = mx.array(list(mine[:FACTS_BYTES].ljust(FACTS_BYTES, b"\0")), dtype=mx.uint8)
    every = mx.distributed.all_gather(padded, group=group).reshape(group.size(), FACTS_BYTES)
    return [json.loads(bytes(row).rstrip(b"\0") or b"{}") for row in every.tolist()]


def describe(report: Report, spec: GroupSpec) -> str:
    lines = [f"group {spec.hostfile}: {report.ranks} ranks over {report.backend}, joined in {report.join_s:.2f} s"]
    lines += [f"  rank {r} {', '.join(spec.hosts[r])}  {fact}" for r, fact in enumerate(report.facts)]
    for link in report.links:
        lines.append(f"  link {link.src} -> {link.dst}: round trip p50 {link.latency_ms_p50:.3f} ms "
                     f"(max {link.latency_ms_max:.3f} ms), {link.bandwidth_gb_s:.2f} GB/s one way")
    lines.append(f"  all_sum of {report.payload_bytes / 2**20:.0f} MiB across the group: {report.all_sum_ms:.1f} ms")
    lines += [f"  problem: {p}" for p in report.problems]
    lines.append("ok" if not report.problems else "problems found")
    return "\n".join(lines)
