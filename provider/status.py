"""`NodeStatus`: one frozen snapshot of the node, the single source `/health`, heartbeats, registration and
logs are mapped from (each front end serialises it its own way; none reaches into the engine or models)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFacts:
    """What a checkpoint is, from its files alone."""

    size_bytes: int  # weight bytes, from the safetensors headers
    family: str
    quantization: str | None
    context_length: int
    native_mtp_heads: bool
    vision: bool


@dataclass(frozen=True)
class ModelStatus:
    id: str
    origin: str  # configured | models_dir | hf_cache
    sha256: str  # the pinned checkpoint hash, or ""
    state: str  # available | loading | ready
    bytes: int = 0  # reserved in the budget while resident
    measured_weight_bytes: int | None = None
    load_active_delta_bytes: int | None = None
    active_jobs: int = 0
    idle_s: float = 0.0
    facts: ModelFacts | None = None  # None while not downloaded, or when its files cannot be read

    @property
    def resident(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True)
class MemoryStatus:
    system_bytes: int  # physical memory
    budget_bytes: int  # before the reserve
    reserve_bytes: int
    usable_bytes: int
    source: str  # where the budget came from
    reserved_bytes: int  # what resident models hold in the budget
    free_bytes: int  # usable minus reserved: what a load may take
    mlx_active_bytes: int
    mlx_peak_bytes: int


@dataclass(frozen=True)
class Counters:
    jobs_completed: int = 0
    jobs_failed: int = 0
    jobs_cancelled: int = 0
    tokens_generated: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_target_forwards: int = 0


@dataclass(frozen=True)
class Platform:
    backend: str  # metal | cpu | cuda
    device: str
    machine: str
    os: str
    cpu_cores: int


@dataclass(frozen=True)
class NodeStatus:
    health: str  # ok | draining | unhealthy
    failure: str | None  # why the engine died, when unhealthy
    default_model: str | None
    models: tuple[ModelStatus, ...]  # every model served, resident or not
    memory: MemoryStatus
    active_jobs: int
    queued_jobs: int
    max_concurrent_jobs: int
    counters: Counters
    platform: Platform
    last_tick: float  # monotonic time of the engine loop's last pass (the service watchdog reads it)

    @property
    def draining(self) -> bool:
        return self.health == "draining"

    @property
    def resident(self) -> list[str]:
        return [m.id for m in self.models if m.resident]
