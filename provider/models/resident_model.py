"""One resident model's record (what it holds in memory, who uses it, how long it may stay idle) and the MLX
memory calls the residency makes around loads and unloads. Read and written under the residency's lock."""

from __future__ import annotations

import concurrent.futures
import gc
from dataclasses import dataclass

from ..memory.admission import Resident, keep_seconds
from ..memory.budget import trim_heaps
from .footprint import Footprint
from .loader import LoadedModel
from .store import StoredModel


@dataclass
class ResidentModel:
    """One model the residency holds or is loading: what it holds in memory and how long it may stay idle."""

    stored: StoredModel
    future: concurrent.futures.Future
    footprint: Footprint | None = None
    lm: LoadedModel | None = None
    measured_weights: int | None = None
    drafter_bytes: int = 0
    active_delta: int | None = None  # raw mx.get_active_memory() growth across the load
    in_use: int = 0
    last_used: float = 0.0
    asked_keep_s: float | None = None  # what the last request or load asked (keep_alive); None: the settings'

    @property
    def ready(self) -> bool:
        return self.lm is not None

    @property
    def bytes(self) -> int:
        """What the model holds: weights, activations, drafter. Its batches' KV is booked apart (admit_batch);
        a load is gated on one sequence of kv_reserve_tokens fitting beside it."""
        if self.footprint is None:
            return 0
        weights = max(self.measured_weights or 0, self.footprint.weights)
        return weights + self.footprint.activations + self.drafter_bytes

    def drafter_status(self) -> dict:
        """Its drafter as its status says it (ModelStatus.drafter_*): the mode, the plan's reason, the bytes held."""
        if self.lm is None:
            return {}
        mode, reason = self.lm.drafter_mode, self.lm.drafter_reason
        return {"drafter_mode": getattr(mode, "value", mode), "drafter_reason": str(getattr(reason, "value", reason)),
                "drafter_bytes": self.drafter_bytes}

    def resident(self, node_ttl: float) -> Resident:
        return Resident(self.stored.id, self.bytes, busy=not self.ready or self.in_use > 0, last_used=self.last_used,
                        keep_s=self.keep_s(node_ttl), pinned=self.stored.pin)

    def keep_s(self, node_ttl: float) -> float | None:
        return keep_seconds(pinned=self.stored.pin, asked=self.asked_keep_s, model_ttl=self.stored.idle_timeout_s,
                            node_ttl=node_ttl)


def mlx_active() -> int:
    import mlx.core as mx

    return mx.get_active_memory()


def free_mlx_cache() -> None:
    """After an unload: what the model held goes back to the system, not only to MLX's and glibc's pools."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    trim_heaps()
