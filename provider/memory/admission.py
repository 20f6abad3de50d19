"""Admission and eviction decisions: pure functions over plain numbers, unit-tested without MLX."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    id: str
    bytes: int  # what it holds now (measured weights + reserved KV and activations)
    busy: bool  # jobs in flight, or still loading: never evicted
    last_used: float
    keep_s: float | None = None  # how long it may stay idle before it is unloaded (keep_seconds); None: for ever
    pinned: bool = False  # never unloaded, not even to make room

    @property
    def evictable(self) -> bool:
        return not self.busy and not self.pinned


@dataclass(frozen=True)
class Admission:
    admit: bool
    evict: tuple[str, ...]  # idle models to unload first, least recently used first
    needed: int
    free: int  # free bytes now, before any eviction
    budget: int
    reason: str  # "ok", "insufficient_memory" or "too_many_models"

    def message(self, model_id: str) -> str:
        mib = 1 << 20
        why = ("more models are resident than max_resident_models and all are busy" if self.reason == "too_many_models"
               else "it does not fit even after evicting every idle model")
        return (f"cannot load {model_id}: needs {self.needed / mib:.1f} MiB, {self.free / mib:.1f} MiB free of a "
                f"{self.budget / mib:.1f} MiB budget; {why}. Retry when jobs finish, or raise memory_budget_gb / "
                "memory_fraction")


def plan_load(needed: int, budget: int, residents: list[Resident], max_resident: int) -> Admission:
    """Admit a load of `needed` bytes, evicting idle models LRU-first only if that makes it fit."""
    free = budget - sum(r.bytes for r in residents)
    idle = sorted((r for r in residents if r.evictable), key=lambda r: r.last_used)
    evict: list[str] = []
    room, count = free, len(residents)
    for r in idle:
        if room >= needed and count < max_resident:
            break
        evict.append(r.id)
        room += r.bytes
        count -= 1
    if room >= needed and count < max_resident:
        return Admission(True, tuple(evict), needed, free, budget, "ok")
    reason = "insufficient_memory" if room < needed else "too_many_models"
    # Evict nothing when the load cannot go ahead: the idle models keep serving.
    return Admission(False, (), needed, free, budget, reason)


FOREVER = float("inf")


def keep_seconds(*, pinned: bool, asked: float | None, model_ttl: float | None, node_ttl: float) -> float | None:
    """How long a model may stay idle before it is unloaded; None: for ever. A pin wins over everything; then
    what the last request or load asked (Ollama's keep_alive: seconds, 0 to unload once idle, FOREVER to keep);
    then the model's own idle_timeout_s; then the node's (0 in either: no idle unloading)."""
    if pinned:
        return None
    if asked is not None:
        return None if asked == FOREVER else max(0.0, asked)
    ttl = node_ttl if model_ttl is None else model_ttl
    return ttl if ttl > 0 else None


def idle_to_unload(residents: list[Resident], now: float) -> list[str]:
    """Models idle for longer than they may be (`keep_s`)."""
    return [r.id for r in residents if r.evictable and r.keep_s is not None and now - r.last_used >= r.keep_s]


ADMIT, WAIT, NEVER = "admit", "wait", "never"


@dataclass(frozen=True)
class JobAdmission:
    decision: str  # admit | wait (until running jobs finish) | never (it could not fit even alone)
    needed: int  # the job's KV bytes
    free: int  # free now: usable minus resident models, running jobs' KV and the prefix caches
    usable: int
    prefix_keep: int  # bytes the prefix caches may keep (less than they hold when they must make room)
    evict: tuple[str, ...]  # idle models to unload first, least recently used first

    def message(self, model_id: str) -> str:
        mib = 1 << 20
        return (f"this job needs {self.needed / mib:.1f} MiB of KV cache on {model_id} (prompt + max_tokens), "
                f"more than the {self.usable / mib:.1f} MiB budget leaves beside the model itself; lower "
                "max_tokens or shorten the prompt, or raise memory_budget_gb / memory_fraction")


def plan_job(needed: int, usable: int, residents: list[Resident], model_id: str, jobs_kv: int,
             prefix_bytes: int, unaccounted: int = 0) -> JobAdmission:
    """Admit a job whose KV takes `needed` more bytes on the resident model `model_id`: from what is free, then
    by dropping prefix caches, then by evicting idle models (LRU first). Otherwise it waits for running jobs,
    unless even an otherwise empty node could not hold it. `unaccounted` is what MLX holds beyond the ledger:
    it is used memory all the same (admission takes the larger of the ledger and MLX's own count)."""
    held = sum(r.bytes for r in residents)
    free = usable - held - jobs_kv - prefix_bytes - unaccounted
    if free >= needed:
        return JobAdmission(ADMIT, needed, free, usable, prefix_bytes, ())
    if free + prefix_bytes >= needed:
        return JobAdmission(ADMIT, needed, free, usable, prefix_bytes - (needed - free), ())
    room, evict = free + prefix_bytes, []
    for r in sorted((r for r in residents if r.evictable and r.id != model_id), key=lambda r: r.last_used):
        evict.append(r.id)
        room += r.bytes
        if room >= needed:
            return JobAdmission(ADMIT, needed, free, usable, 0, tuple(evict))
    own = sum(r.bytes for r in residents if r.id == model_id)
    decision = NEVER if needed > usable - own else WAIT
    return JobAdmission(decision, needed, free, usable, prefix_bytes, ())
