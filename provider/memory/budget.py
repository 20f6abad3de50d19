"""The working-set budget: how many bytes this node may fill with weights, KV and activations.

`decide_budget` is pure (plain numbers in, a Budget out); `system_facts` reads
the platform and `pin_mlx_limits` applies the decision to MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class SystemFacts:
    total_memory: int  # physical RAM (psutil)
    available_memory: int  # what the OS says is free now (psutil)
    recommended_working_set: int | None  # Metal's max_recommended_working_set_size; None elsewhere
    backend: str  # metal | cpu | cuda
    device: str = ""  # the device's name, as MLX reports it


@dataclass(frozen=True)
class Budget:
    total: int  # bytes the node may use, before the reserve
    reserve: int  # kept back for the OS, other processes and MLX's own scratch
    source: str  # where `total` came from

    @property
    def usable(self) -> int:
        return max(0, self.total - self.reserve)

    def as_dict(self) -> dict:
        return {"total_bytes": self.total, "reserve_bytes": self.reserve, "usable_bytes": self.usable,
                "source": self.source}


def decide_budget(facts: SystemFacts, *, fraction: float, reserve_bytes: int, override_bytes: int = 0) -> Budget:
    """Configured override > Metal's recommended working set > fraction of system memory."""
    if override_bytes > 0:
        return Budget(override_bytes, 0, "configured memory_budget_gb")
    if facts.recommended_working_set:
        return Budget(facts.recommended_working_set, reserve_bytes, "mlx max_recommended_working_set_size")
    return Budget(int(facts.total_memory * fraction), reserve_bytes, f"system memory x {fraction:g} (psutil)")


def system_facts() -> SystemFacts:
    import mlx.core as mx
    import psutil

    vm = psutil.virtual_memory()
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    metal = bool(getattr(mx, "metal", None) and mx.metal.is_available())
    cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    return SystemFacts(
        total_memory=vm.total,
        available_memory=vm.available,
        recommended_working_set=info.get("max_recommended_working_set_size"),
        backend="metal" if metal else "cuda" if cuda else "cpu",
        device=str(info.get("device_name", "")),
    )


def pin_mlx_limits(budget: Budget) -> None:
    """Cap MLX at the budget so an over-estimate fails as an allocation error, not as swapping; and have the C
    allocator give large freed buffers back (return_freed_buffers)."""
    import mlx.core as mx

    if budget.usable > 0:
        mx.set_memory_limit(budget.usable)
        # Freed buffers MLX keeps for reuse count against the budget too; keep that pool modest.
        mx.set_cache_limit(min(budget.usable // 8, 2 * GiB))
    return_freed_buffers()


MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_buffers() -> bool:
    """Buffers of a MiB or more (images' pixels, decoded frames) from their own mappings, returned to the system
    when freed. glibc raises its threshold to the size of each mapped buffer freed (up to 32 MiB), after which
    such buffers come from a heap that keeps them: measured here, 16 small and 5 larger images left the node
    170 MiB above its ledger once they were read, in no booking; with a fixed threshold, 12 MiB. Linux (glibc)
    only; True if it applied."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def trim_heaps() -> bool:
    """Give the free pages inside glibc's heaps back to the system (malloc_trim): a model's many small tensors
    come from those heaps, and without this an unload left its RSS in them. Linux (glibc) only; True if it
    released anything."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


_heap_frozen = False


def freeze_startup_heap(collect: bool = True) -> None:
    """Once per process, when a node starts: move every object alive now (imports, settings, the catalog) out of
    the cycle collector's reach. An unload's full collection then scans only what came after; before this it
    scanned the whole startup heap for ~0.13 s holding the GIL, and a flood of warm and release frames starved
    the session's event loop (300 frames took 21 s, with 150 load/unload cycles, instead of 0.4 s).
    `collect=False` (a one-shot command, which exits soon after) freezes what is garbage already too, rather than
    pay a full collection of the whole heap (~0.1 s) to free it first."""
    import gc

    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        if collect:
            gc.collect()  # what is garbage already is freed, not frozen
        gc.freeze()
