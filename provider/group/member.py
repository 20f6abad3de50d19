"""Joining a node group, the same on every rank: connect, agree on the model and on rank 0's engine settings,
and learn every rank's memory; then a watchdog on step progress, since MLX's collectives wait without end."""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import logs
from ..memory.budget import Budget
from ..memory.estimate import KVQuant
from ..settings import KV_BITS, KV_GROUP_SIZES
from .doorbell import open_doorbell
from ..engine.collective import GroupLost
from .link import Link, join
from .spec import GroupSpec

log = logs.get("group")
EXIT_GROUP_LOST = 69  # EX_UNAVAILABLE: a rank was lost; the service manager restarts this one


@dataclass(frozen=True)
class EngineShape:
    """What every rank's batches must share for their steps to be the same: rank 0's."""

    step_tokens: int
    max_rows: int
    kv_bits: int = 0  # the model's KV precision (0: full), so every rank makes the same caches (engine.kv_quant)
    kv_group_size: int = 64

    def kv_quant(self) -> KVQuant | None:
        return KVQuant(self.kv_bits, self.kv_group_size) if self.kv_bits else None


def _engine_shape(raw: dict) -> EngineShape:
    """Rank 0's engine shape as it came: two counts in range and a KV precision, or the group cannot agree on its
    steps."""
    counts = (raw.get("step_tokens"), raw.get("max_rows"))
    if set(raw) != {"step_tokens", "max_rows", "kv_bits", "kv_group_size"} \
            or not all(type(v) is int and 0 < v <= 1 << 20 for v in counts) \
            or raw["kv_bits"] not in KV_BITS or raw["kv_group_size"] not in KV_GROUP_SIZES \
            or not all(type(raw[k]) is int for k in ("kv_bits", "kv_group_size")):
        raise GroupLost("rank 0's engine shape is not two counts in range and a KV precision: the group stops")
    return EngineShape(**raw)


@dataclass(frozen=True)
class Membership:
    spec: GroupSpec
    link: Link
    engine: EngineShape
    budgets: tuple[int, ...]  # each rank's usable memory budget, by rank
    memory: tuple[int, ...]  # each rank's total memory, by rank

    def budget(self) -> Budget:
        """What admission may book on each rank: the smallest rank's budget (each rank holds its share)."""
        smallest = min(range(len(self.budgets)), key=self.budgets.__getitem__)
        return Budget(self.budgets[smallest], 0, f"the smallest budget of the group's {len(self.budgets)} ranks "
                                                 f"(rank {smallest})")


def join_group(spec: GroupSpec, timeout_s: float, step_timeout_s: float, model_id: str, model_path: Path,
               engine: EngineShape, budget: Budget, total_memory: int) -> Membership:
    """Connect to the other ranks, then check in three collectives that every rank serves the same checkpoint
    (its id and config), take rank 0's engine shape, and learn every rank's memory."""
    link = Link(join(spec, timeout_s), spec.key)
    config = (model_path / "config.json").read_bytes() if (model_path / "config.json").exists() else b""
    if not link.agree([zlib.crc32(model_id.encode()) & 0x7FFFFFFF, zlib.crc32(config) & 0x7FFFFFFF]):
        raise GroupLost(f"the ranks of {spec.hostfile} were started with different models (this rank: {model_id} "
                        f"from {model_path}); start every rank with the same --model")
    engine = _engine_shape(link.share("engine", dataclasses.asdict(engine)))
    budgets = link.gather(budget.usable)
    memory = link.gather(total_memory)
    link.doorbell = open_doorbell(link, spec, timeout_s, step_timeout_s)
    log.info("group_joined", rank=spec.rank, ranks=spec.size, backend=spec.backend, model=model_id,
             budgets=[int(b) for b in budgets])
    return Membership(spec, link, engine, tuple(int(b) for b in budgets), tuple(int(m) for m in memory))


@dataclass(frozen=True)
class Joined:
    membership: Membership
    model_id: str
    path: Path
    tokenizer_files: Callable  # the catalog's: model id -> (directory, config)


def join_with_settings(settings, spec: GroupSpec, budget: Budget, step_tokens: int) -> Joined:
    """`join_group` for this process's settings: the one model a group serves (--model, or the default), this
    machine's engine shape (rank 0's wins), budget and memory."""
    from ..memory.budget import system_facts
    from ..models import store
    from ..models.catalog import Catalog
    from ..models.default import primary_models

    catalog = Catalog(store.discover(settings, primary_models(settings))[:1])
    model_id = catalog.default_id
    path, _ = catalog.checkpoint(model_id)
    bits, group = catalog.stored(model_id).kv_precision(settings.kv_bits, settings.kv_group_size)
    membership = join_group(spec, settings.group_timeout_s, settings.group_step_timeout_s, model_id, path,
                            EngineShape(step_tokens, settings.max_concurrent_jobs, bits, group), budget,
                            system_facts().total_memory)
    return Joined(membership, model_id, path, catalog.tokenizer_files)


class Watchdog:
    """Calls `on_stall(why)` once if what it awaits does not beat for `timeout_s` after `arm()`: a rank alive but
    stuck holds every other rank inside a collective, which no error will ever end. What is awaited changes over
    a rank's life (`expect`): joining, loading its share, then each step."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str], None], awaiting: str = "a step of the group"):
        self.timeout_s = timeout_s
        self.awaiting = awaiting
        self._on_stall = on_stall
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="group-watchdog", daemon=True)

    def arm(self) -> None:
        self.beat()
        if not self._thread.is_alive():
            self._thread.start()

    def expect(self, awaiting: str, timeout_s: float) -> None:
        """From now on, `awaiting` must beat within `timeout_s`."""
        self.awaiting, self.timeout_s = awaiting, timeout_s
        self.arm()

    def beat(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            quiet = time.monotonic() - self._last
            if quiet > self.timeout_s:
                why = f"{self.awaiting} did not complete in {quiet:.0f} s: a rank is stalled or gone"
                log.critical("group_stalled", awaiting=self.awaiting, seconds=round(quiet, 1))
                self._on_stall(why)
                return
