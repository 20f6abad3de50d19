"""What the node tells the coordinator about itself: the Registration and each Heartbeat."""

from __future__ import annotations

import os
import platform
import time
from functools import lru_cache
from pathlib import Path

from provider.memory import estimate
from provider.memory.budget import system_facts
from provider.models import capability
from provider.node import Node

from .identity import Identity
from .pb import provider_pb2 as pb

BACKENDS = {"metal": pb.BACKEND_METAL, "cpu": pb.BACKEND_CPU, "cuda": pb.BACKEND_CUDA}


def memory_status(node: Node) -> pb.MemoryStatus:
    m = node.models.memory()
    return pb.MemoryStatus(total_bytes=system_facts().total_memory, budget_bytes=m["usable_bytes"],
                           free_for_load_bytes=m["free_bytes"], active_bytes=m["mlx_active_bytes"],
                           budget_source=m["source"])


@lru_cache(maxsize=256)
def _model_facts(path: Path, mtime_ns: int) -> tuple[int, pb.Capabilities]:
    config = capability.read_config(path)
    caps = capability.detect(path, config)
    return estimate.weight_bytes(path, config), pb.Capabilities(
        family=caps.family, quantization=caps.quantization or "", context_length=caps.context_length,
        native_mtp_heads=caps.native_mtp_heads, vision=caps.vision)


def model_infos(node: Node) -> list[pb.ModelInfo]:
    resident = set(node.models.resident())
    out = []
    for model_id in node.models.ids():
        stored = node.models.stored(model_id)
        info = pb.ModelInfo(id=model_id, sha256=stored.sha256 or "", resident=model_id in resident)
        if stored.path is not None:
            try:
                info.size_bytes, caps = _model_facts(stored.path, (stored.path / "config.json").stat().st_mtime_ns)
                info.capabilities.CopyFrom(caps)
            except Exception:  # a broken checkpoint is advertised without details; a job for it gets the error
                pass
        out.append(info)
    return out


def registration(node: Node, identity: Identity, *, nonce: bytes, epoch: int, protocol_version: int,
                 software_version: str) -> pb.Registration:
    import mlx.core as mx

    facts = system_facts()
    device = mx.device_info().get("device_name", "") if hasattr(mx, "device_info") else ""
    return pb.Registration(
        node_id=identity.node_id, protocol_version=protocol_version, software_version=software_version,
        backend=BACKENDS.get(facts.backend, pb.BACKEND_UNSPECIFIED),
        hardware=pb.Hardware(machine=platform.machine(), chip=device, os=f"{platform.system()} {platform.release()}",
                             cpu_cores=os.cpu_count() or 0),
        memory=memory_status(node), models=model_infos(node),
        max_concurrent_jobs=node.settings.max_concurrent_jobs, public_key=identity.public_key, nonce=nonce,
        timestamp_ms=int(time.time() * 1000), session_epoch=epoch)


def heartbeat(node: Node, *, draining: bool) -> pb.Heartbeat:
    stats = node.engine.stats
    status = (pb.NODE_STATUS_UNHEALTHY if not node.healthy
              else pb.NODE_STATUS_DRAINING if draining or node.engine.draining
              else pb.NODE_STATUS_BUSY if stats.active else pb.NODE_STATUS_IDLE)
    return pb.Heartbeat(
        status=status, resident_models=node.models.resident(), active_jobs=stats.active, queued_jobs=stats.queued,
        memory=memory_status(node),
        counters=pb.Counters(jobs_completed=stats.jobs_completed, jobs_failed=stats.jobs_failed,
                             jobs_cancelled=stats.jobs_cancelled, tokens_generated=stats.tokens_generated,
                             spec_drafted_tokens=stats.spec_drafted, spec_accepted_tokens=stats.spec_accepted,
                             spec_target_forwards=stats.spec_target_forwards),
        timestamp_ms=int(time.time() * 1000))
