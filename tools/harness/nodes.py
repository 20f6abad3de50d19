"""In-process nodes over local checkpoints, and a node with a live coordinator session against the reference
coordinator on loopback: what the tests, tools/scripts/fault_report.py and the fuzz campaign drive."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from coordinator_client.identity import Identity
from coordinator_client.outcomes import brief
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from coordinator_client.session import CoordinatorSession
from provider.memory.budget import Budget
from provider.models.catalog import Catalog
from provider.models.residency import Residency
from provider.models.store import StoredModel
from provider.node import Node
from provider.settings import Settings
from provider.speculation import SpeculationConfig


def make_manager(models: dict[str, Path], budget_bytes: int = 4 << 30, drafters: dict[str, Path] | None = None,
                 pins: tuple[str, ...] = (), **kw) -> Residency:
    drafters = drafters or {}
    stored = [StoredModel(k, str(v), v if v.is_dir() else None, "configured",
                          drafter=str(drafters[k]) if k in drafters else None, pin=k in pins) for k, v in models.items()]
    return Residency(Catalog(stored, allow_download=False), Budget(budget_bytes, 0, "test"), **kw)


def make_node(models: dict[str, Path], budget_bytes: int = 4 << 30, manager_kw: dict | None = None,
              **settings) -> Node:
    s = Settings(**settings)  # the one place the speculation policy and k are set
    node = Node(s, make_manager(models, budget_bytes, speculation=SpeculationConfig.of(s), **(manager_kw or {})))
    node.start()
    return node


FAST_RECONNECT = dict(reconnect_base_delay_s=0.05, reconnect_max_delay_s=0.5, healthy_session_s=0.5)


@contextlib.asynccontextmanager
async def harness(models: dict[str, Path], state_dir: Path, *, coordinator: ReferenceCoordinator | None = None,
                  manager_kw: dict | None = None, **settings):
    coord = coordinator or ReferenceCoordinator(heartbeat_interval_ms=200)
    if coordinator is None:
        await coord.start()
    node = make_node(models, manager_kw=manager_kw, **({"max_concurrent_jobs": 4} | settings))
    st = Settings(coordinator=coord.url, **(FAST_RECONNECT | settings))
    session = CoordinatorSession(node, st, Identity.load_or_create(state_dir))
    stop = asyncio.Event()
    task = asyncio.create_task(session.run(stop))
    try:
        yield coord, node, session
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await node.stop()
        await coord.kill()


def job(job_id: str, model: str, *, prompt: str = "The cache", max_tokens: int = 16, temperature: float = 0.0,
        **kw) -> pb.JobRequest:
    return pb.JobRequest(job_id=job_id, model=model, prompt=prompt, max_tokens=max_tokens,
                         sampling=pb.SamplingParams(temperature=temperature), **kw)


@dataclass
class FaultReport:
    cycles: int
    sessions: int = 0
    reconnects: int = 0
    max_reconnect_delay_s: float = 0.0
    jobs: int = 0
    jobs_with_one_outcome: int = 0
    jobs_without_outcome: int = 0
    jobs_with_conflicting_outcomes: int = 0
    outcome_redeliveries: int = 0
    coordinator_lost: int = 0
    completed_streams: int = 0
    completed_streams_with_gaps_or_duplicates: int = 0
    rss_mb: list[float] = field(default_factory=list)

    @property
    def rss_growth_mb(self) -> float:
        # Compare the settled second half with the first cycles, so one-off warm-up does not count.
        half = len(self.rss_mb) // 2
        return statistics.median(self.rss_mb[half:]) - statistics.median(self.rss_mb[:max(half, 1)])

    def lines(self) -> list[str]:
        return [
            f"kill/restart cycles: {self.cycles}",
            f"sessions welcomed: {self.sessions} (reconnects: {self.reconnects})",
            f"max reconnect delay: {self.max_reconnect_delay_s:.3f} s",
            f"jobs dispatched: {self.jobs}",
            f"jobs with exactly one outcome: {self.jobs_with_one_outcome}",
            f"jobs without an outcome: {self.jobs_without_outcome}",
            f"jobs with conflicting outcomes: {self.jobs_with_conflicting_outcomes}",
            f"outcome redeliveries (same outcome resent after a kill, deduplicated): {self.outcome_redeliveries}",
            f"jobs ended coordinator_lost: {self.coordinator_lost}",
            f"completed streams: {self.completed_streams}, with gaps or duplicate seqs: "
            f"{self.completed_streams_with_gaps_or_duplicates}",
            f"node RSS per cycle (MB): {' '.join(f'{x:.0f}' for x in self.rss_mb)}; "
            f"growth {self.rss_growth_mb:+.1f} MB",
        ]


async def kill_restart_scenario(model_path: Path, state_dir: Path, cycles: int = 10) -> FaultReport:
    """`cycles` kills and restarts of the coordinator under a node serving jobs. The node's RSS per cycle is this
    process's: run it in a process of its own (tools/scripts/fault_report.py is one; the test uses
    tools.harness.isolated), where nothing else allocates."""
    report = FaultReport(cycles)
    coord = ReferenceCoordinator(heartbeat_interval_ms=200)
    await coord.start()
    proc = psutil.Process()  # this process: the node runs in it
    async with harness({"m": model_path}, state_dir, coordinator=coord) as (_, node, session):
        session_now = await coord.wait_for_node(30)
        job_ids = []
        for cycle in range(cycles):
            ids = [f"c{cycle}-long-{i}" for i in range(2)] + [f"c{cycle}-short"]
            for jid in ids:
                coord.dispatch(session_now, job(jid, "m", max_tokens=400 if "long" in jid else 6))
            job_ids += ids
            # Kill once the short job has completed and the long ones are mid-stream.
            await coord.outcome(ids[2], timeout=60)
            for _ in range(2000):
                if all(len(coord.chunks[j]) >= 3 for j in ids[:2]):
                    break
                await asyncio.sleep(0.005)
            await coord.restart()
            session_now = await coord.wait_for_node(30, after=session_now.session_id)
            report.rss_mb.append(proc.memory_info().rss / 2**20)
        # Let redelivered outcomes arrive and the last jobs finish.
        for jid in job_ids:
            with contextlib.suppress(asyncio.TimeoutError):
                await coord.outcome(jid, timeout=60)
        report.sessions = session.stats.sessions
        report.reconnects = len(session.stats.reconnect_delays)
        report.max_reconnect_delay_s = max(session.stats.reconnect_delays, default=0.0)

    report.jobs = len(job_ids)
    session_of: dict[tuple[str, str], str] = {}
    for sid, kind, frame in coord.frames:
        if kind in ("job_accepted", "job_done", "job_error"):
            session_of.setdefault((kind, getattr(frame, kind).job_id), sid)
    for jid in job_ids:
        outcomes = coord.outcomes.get(jid, [])
        distinct = {brief(o).SerializeToString() for o in outcomes}  # a resend adds only the completion's body
        if not outcomes:
            report.jobs_without_outcome += 1
            continue
        if len(distinct) > 1:
            report.jobs_with_conflicting_outcomes += 1
            continue
        report.jobs_with_one_outcome += 1
        report.outcome_redeliveries += len(outcomes) - 1
        first = outcomes[0]
        if first.WhichOneof("frame") == "job_error":
            report.coordinator_lost += first.job_error.cause == pb.ERROR_CAUSE_COORDINATOR_LOST
        elif session_of.get(("job_done", jid)) == session_of.get(("job_accepted", jid)):
            # Completed and delivered on the stream that carried it: its chunks must be whole.
            report.completed_streams += 1
            seqs = [c.seq for c in coord.chunks[jid]]
            tokens = sum(len(c.token_ids) for c in coord.chunks[jid])
            if seqs != list(range(len(seqs))) or tokens != first.job_done.usage.completion_tokens:
                report.completed_streams_with_gaps_or_duplicates += 1
    return report
