"""`NodeStatus`: one frozen snapshot of the node, the single source `/health`, heartbeats, registration and
logs are mapped from (each front end serialises it its own way; none reaches into the engine or models)."""

from __future__ import annotations

import dataclasses
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
    mtp_capable: bool = False  # speculates in mtp mode: its own MTP head, or a paired Gemma 4 assistant
    draft_compatible: bool = False  # a configured draft model pairs with it
    speculates_with: str = ""  # own_mtp_head | mtp_assistant | eagle3 | dflash | draft_model | "" (Capabilities)


@dataclass(frozen=True)
class ModelStatus:
    id: str
    origin: str  # configured | models_dir | hf_cache
    sha256: str  # the manifest hash of its files once computed, else the configured pin, else ""
    state: str  # available | loading | ready
    bytes: int = 0  # reserved in the budget while resident
    measured_weight_bytes: int | None = None
    load_active_delta_bytes: int | None = None
    active_jobs: int = 0
    idle_s: float = 0.0
    load_seconds: float | None = None
    facts: ModelFacts | None = None  # None while not downloaded, or when its files cannot be read
    drafter_sha256: str = ""  # the same for its drafter, when it has one
    speculation: dict | None = None  # a resident pair's measured costs and auto's k (SpecProfile.as_dict)
    # Where those costs came from (models.profile_store): source file | measured (and when, and the file), or
    # measuring (auto decodes plain meanwhile); `measuring` also marks a stale file being measured again.
    speculation_profile: dict | None = None
    pinned: bool = False  # loaded at start and never unloaded
    keep_alive_s: float | None = None  # how long it may stay idle before it is unloaded; None: for ever
    unload_at: float | None = None  # unix time it unloads if nothing uses it before; None: busy or kept
    drafter_mode: str | None = None  # a loaded model's drafter: mtp | draft, or None when it serves alone
    drafter_reason: str = ""  # a loaded model's drafter plan: ok, or why it has none (the stable reasons)
    drafter_bytes: int = 0  # of `bytes`, what its drafter holds

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
    reserved_bytes: int  # models + jobs' KV + prefix caches
    free_bytes: int  # usable minus reserved: what a load or a job's KV may take
    mlx_active_bytes: int
    mlx_peak_bytes: int
    models_bytes: int = 0  # resident models' weights, activations and drafters
    jobs_kv_bytes: int = 0  # KV the running jobs' batches will hold at their longest (padded rows included)
    prefix_cache_bytes: int = 0  # KV kept for prefix reuse and its token index (dropped first when room is needed)
    unaccounted_bytes: int = 0  # what MLX holds beyond reserved_bytes; admission counts it as used
    responses_store_bytes: int = 0  # the local API's stored responses (previous_response_id), in reserved_bytes


@dataclass
class Counters:
    """Totals since start. The engine adds to its own (EngineStats); NodeStatus holds a copy."""

    jobs_completed: int = 0
    jobs_failed: int = 0
    jobs_cancelled: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_target_forwards: int = 0
    proofs_made: int = 0  # outcomes that carried a proof (a committing node's, docs/verification.md)
    verify_jobs: int = 0  # verify jobs this node ran on another node's claim
    verify_passed: int = 0  # of them, those whose verdict passed


@dataclass
class QueueStatus:
    """The queue and batching, as the engine counts them (EngineStats); NodeStatus holds a copy."""

    waiting_for_memory: int = 0  # queued jobs whose KV does not fit until running jobs finish
    oldest_wait_s: float = 0.0  # how long the longest-waiting queued job has waited
    batch_steps: int = 0  # batched decode steps run
    batch_rows: int = 0  # rows decoded over those steps (batch_rows / batch_steps: the mean batch size)
    prefix_hits: int = 0  # jobs that reused a cached prompt prefix
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    prefix_disk_tokens: int = 0  # of them, those read back from its disk tier


@dataclass
class EngineStats(Counters, QueueStatus):
    """The engine's live counts, written by its thread only: every counter and queue figure, and the jobs
    running and queued now. `counters()` and `queue()` are the copies a NodeStatus carries."""

    active: int = 0
    queued: int = 0

    def counters(self) -> Counters:
        return _copy_as(Counters, self)

    def queue(self) -> QueueStatus:
        return _copy_as(QueueStatus, self)


def _copy_as(kind, source):
    return kind(**{f.name: getattr(source, f.name) for f in dataclasses.fields(kind)})


@dataclass(frozen=True)
class Platform:
    backend: str  # metal | cpu | cuda
    device: str
    machine: str
    os: str
    cpu_cores: int


@dataclass(frozen=True)
class GroupStatus:
    """A node group's ranks, as rank 0 learned them when the group formed (docs/group.md)."""

    ranks: int
    backend: str  # ring | jaccl
    memory_bytes: tuple[int, ...]  # each rank's system memory, by rank
    budget_bytes: tuple[int, ...]  # each rank's usable budget, by rank; admission books against the smallest


@dataclass(frozen=True)
class PrefixDiskStatus:
    """The prefix cache's disk tier (engine.prefix_disk)."""

    bytes: int  # on disk now
    budget_bytes: int
    entries: int
    hits: int  # entries read back
    tokens_reused: int  # prompt tokens whose KV came from disk
    writes: int
    bytes_written: int
    write_bytes_per_hour: float  # since the node started (its bound: write_bytes_per_hour_limit)
    write_bytes_per_hour_limit: int
    skipped_writes: int  # over the write rate, or the writer's queue full
    refused_files: int  # truncated, corrupted or foreign: deleted, never loaded


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
    queue: QueueStatus = dataclasses.field(default_factory=QueueStatus)  # the queue and batching, from the engine
    group: GroupStatus | None = None  # rank 0 of a node group: the group it leads
    prefix_disk: PrefixDiskStatus | None = None  # the prefix cache's disk tier, when on
    commits: bool = False  # every outcome carries a proof (Settings.committing)

    @property
    def draining(self) -> bool:
        return self.health == "draining"

    @property
    def resident(self) -> list[str]:
        return [m.id for m in self.models if m.resident]
