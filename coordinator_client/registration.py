"""What the node tells the coordinator about itself: the Registration and each Heartbeat, from NodeStatus."""

from __future__ import annotations

import time

from provider.speculation import GREEDY, SPECULATIVE_SAMPLING
from provider.status import NodeStatus
from provider.proofs.verdicts import for_backend

from .convert import decision_to_pb, tolerance_to_pb
from .identity import Identity
from .residency import residency_of
from .pb import provider_pb2 as pb

BACKENDS = {"metal": pb.BACKEND_METAL, "cpu": pb.BACKEND_CPU, "cuda": pb.BACKEND_CUDA}


def memory_status(st: NodeStatus) -> pb.MemoryStatus:
    m = st.memory
    total = sum(st.group.memory_bytes) if st.group is not None else m.system_bytes  # a group's: all its ranks'
    return pb.MemoryStatus(total_bytes=total, budget_bytes=m.usable_bytes, free_for_load_bytes=m.free_bytes,
                           active_bytes=m.mlx_active_bytes, budget_source=m.source)


def node_group(st: NodeStatus) -> pb.NodeGroup | None:
    g = st.group
    return None if g is None else pb.NodeGroup(ranks=g.ranks, backend=g.backend, rank_memory_bytes=g.memory_bytes,
                                               rank_budget_bytes=g.budget_bytes)


def model_infos(st: NodeStatus) -> list[pb.ModelInfo]:
    out = []
    for m in st.models:
        info = pb.ModelInfo(id=m.id, sha256=m.sha256, resident=m.resident, drafter_sha256=m.drafter_sha256)
        if m.facts is not None:  # without facts (not downloaded, unreadable) a model is advertised by id alone
            f = m.facts
            info.size_bytes = f.size_bytes
            info.capabilities.CopyFrom(pb.Capabilities(
                family=f.family, quantization=f.quantization or "", context_length=f.context_length,
                native_mtp_heads=f.native_mtp_heads, vision=f.vision, mtp_capable=f.mtp_capable,
                draft_compatible=f.draft_compatible, speculates_with=f.speculates_with))
        out.append(info)
    return out


def registration(st: NodeStatus, identity: Identity, *, nonce: bytes, epoch: int, protocol_version: int,
                 software_version: str, sealing_key: bytes = b"") -> pb.Registration:
    p = st.platform
    return pb.Registration(
        node_id=identity.node_id, protocol_version=protocol_version, software_version=software_version,
        backend=BACKENDS.get(p.backend, pb.BACKEND_UNSPECIFIED),
        hardware=pb.Hardware(machine=p.machine, chip=p.device, os=p.os, cpu_cores=p.cpu_cores),
        memory=memory_status(st), models=model_infos(st), max_concurrent_jobs=st.max_concurrent_jobs,
        public_key=identity.public_key, nonce=nonce, timestamp_ms=int(time.time() * 1000), session_epoch=epoch,
        sealing_key=sealing_key, group=node_group(st),
        verification=pb.Verification(commits=st.commits, tolerance=tolerance_to_pb(for_backend(p.backend))))


HEALTH = {"unhealthy": pb.NODE_STATUS_UNHEALTHY, "draining": pb.NODE_STATUS_DRAINING}


def heartbeat(st: NodeStatus, *, draining: bool, prefix_hashes: list[int] = ()) -> pb.Heartbeat:
    status = HEALTH.get(st.health) or (pb.NODE_STATUS_DRAINING if draining
                                       else pb.NODE_STATUS_BUSY if st.active_jobs else pb.NODE_STATUS_IDLE)
    c = st.counters
    return pb.Heartbeat(
        status=status, resident_models=st.resident, active_jobs=st.active_jobs, queued_jobs=st.queued_jobs,
        memory=memory_status(st),
        counters=pb.Counters(jobs_completed=c.jobs_completed, jobs_failed=c.jobs_failed,
                             jobs_cancelled=c.jobs_cancelled, tokens_generated=c.tokens_generated,
                             spec_drafted_tokens=c.spec_drafted, spec_accepted_tokens=c.spec_accepted,
                             spec_target_forwards=c.spec_target_forwards),
        timestamp_ms=int(time.time() * 1000),
        speculation=[_profile(m.id, m.speculation) for m in st.models if m.speculation], group=node_group(st),
        residency=residency_of(st.models), prefix_hashes=prefix_hashes)


def _profile(model: str, p: dict) -> pb.SpeculationProfile:
    return pb.SpeculationProfile(
        model=model, plain_token_ms=p["plain_token_ms"], round_ms=p["round_ms"], greedy=decision_to_pb(p[GREEDY]),
        sampled=decision_to_pb(p[SPECULATIVE_SAMPLING]), rows=p["rows"], plain_rows_ms=p["plain_rows_ms"],
        round_rows_ms=p["round_rows_ms"])
