"""The resident set under a memory budget: models load on first use and idle ones are evicted.

Loads run on one loader thread, so the engine keeps decoding other models meanwhile; every job that wants
a model still loading waits on the same future (one load). A target and its drafter are planned together
from what their files say (`models.load_needs`; `memory.admission.plan_load`, then `speculation.plan_drafter`
for the headroom left), then loaded by `loader.load_pair`; the measured size replaces the estimate. The
engine thread is the only caller of `request`/`acquire`/`release`/`unload_idle`; any thread may read
`statuses`/`memory_status`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable

from .. import logs
from ..jobs import JobError
from ..types import Cause, Policy, SpecReason
from ..memory.admission import ADMIT, JobAdmission, idle_to_unload, plan_job, plan_load
from ..memory.batch_kv import plain_batch_bytes
from ..memory.estimate import KVShape
from ..memory.budget import Budget
from ..speculation import SpeculationConfig, plan_drafter, plan_group_drafter
from ..status import MemoryStatus, ModelStatus
from . import loader, manifest
from .catalog import Catalog
from .load_needs import load_needs
from .loader import LoadedModel
from .resident_model import ResidentModel, free_mlx_cache, mlx_active
from ..drafters.mtp.split_lm_head import held_bytes
from .spec_profiles import SpecProfiles

log = logs.get("models")


class Residency:
    def __init__(self, catalog: Catalog, budget: Budget, *, max_resident: int = 2, idle_timeout: float = 0.0,
                 kv_reserve_tokens: int = 4096, prefill_step: int = 2048,
                 speculation: SpeculationConfig = SpeculationConfig(), group=None, group_split: str = "auto",
                 kv_bits: int = 0, kv_group_size: int = 64):
        self.catalog = catalog
        self.group = group  # a node group's mx.distributed Group: loads split across it, per-rank sizes
        self._ranks = group.size() if group is not None else 1
        self.group_split = group_split  # tensor, pipeline or auto (loader.choose_split)
        self.budget = budget
        self._max_resident = max_resident
        self._idle_timeout = idle_timeout
        self._kv_tokens = kv_reserve_tokens
        self._prefill_step = prefill_step
        self._kv_bits, self._kv_group_size = kv_bits, kv_group_size  # the node's; a model's own config wins
        self.speculation = speculation  # the node's one owner of policy and k; the engine reads it here
        self._entries: dict[str, ResidentModel] = {}
        # KV each model's batches will hold, worst case (memory.batch_kv), booked by the engine as rows come and go.
        self._batch_kv: dict[str, int] = {}
        # What MLX held before this residency is not its own (in a daemon nothing; beside other users of MLX, theirs).
        self._mlx_baseline = mlx_active()
        self._next_ledger_warning = 0.0
        self.prefix_bytes = 0  # what the engine's prefix caches hold; set by the engine thread
        self.responses_bytes = 0  # the local API's stored responses (outside MLX, booked beside it); set by the node
        self._lock = threading.Lock()
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-loader")
        self.loads_started = 0
        self.evictions = 0
        self.profiler: Callable[[LoadedModel], object] | None = None  # auto's costs: engine.profile.Profiler
        self._profiles = SpecProfiles()

    # --- any thread ---------------------------------------------------------------

    def resident(self) -> list[str]:
        with self._lock:
            return [mid for mid, e in self._entries.items() if e.ready]

    def memory_status(self, system_bytes: int) -> MemoryStatus:
        import mlx.core as mx

        with self._lock:
            models = sum(e.bytes for e in self._entries.values())
            jobs = sum(self._batch_kv.values())
        prefix, responses, active = self.prefix_bytes, self.responses_bytes, mlx_active()
        used = models + jobs + prefix
        unaccounted = max(0, active - self._mlx_baseline - used)
        b = self.budget
        return MemoryStatus(system_bytes=system_bytes, budget_bytes=b.total, reserve_bytes=b.reserve,
                            usable_bytes=b.usable, source=b.source, reserved_bytes=used + responses,
                            free_bytes=max(0, b.usable - used - responses - unaccounted), mlx_active_bytes=active,
                            mlx_peak_bytes=mx.get_peak_memory(), models_bytes=models, jobs_kv_bytes=jobs,
                            prefix_cache_bytes=prefix, unaccounted_bytes=unaccounted, responses_store_bytes=responses)

    def unaccounted_bytes(self) -> int:
        """What MLX holds beyond the ledger (models, batches' KV, prefix caches): admission counts it as used,
        so a ledger that falls behind reality costs headroom, not an out-of-memory kill."""
        with self._lock:
            return self._unaccounted_locked()

    def check_ledger(self) -> None:
        """Say so when MLX holds more than 10 % beyond the ledger (at most once a minute): the estimates behind
        admission are off for this model or load, and admission is running on MLX's own count meanwhile."""
        with self._lock:
            ledger, unaccounted = self._ledger_locked(), self._unaccounted_locked()
        now = time.monotonic()
        if unaccounted > 0.10 * ledger and now >= self._next_ledger_warning:
            self._next_ledger_warning = now + 60.0
            log.warning("memory_ledger_behind", unaccounted_bytes=unaccounted, ledger_bytes=ledger,
                        mlx_active_bytes=mlx_active())

    def _unaccounted_locked(self) -> int:
        return max(0, mlx_active() - self._mlx_baseline - self._ledger_locked())

    def _ledger_locked(self) -> int:
        return sum(e.bytes for e in self._entries.values()) + sum(self._batch_kv.values()) + self.prefix_bytes

    def statuses(self) -> list[ModelStatus]:
        """Every model served, resident or not, with what its files say it is."""
        with self._lock:
            entries = dict(self._entries)
        now = time.monotonic()
        out = []
        for mid in self.catalog.ids():
            stored, e = self.catalog.stored(mid), entries.get(mid)
            status = ModelStatus(mid, stored.origin, self.catalog.known_hash(mid) or stored.sha256 or "", "available",
                                 facts=self.catalog.facts(mid),
                                 drafter_sha256=self.catalog.known_hash(mid, drafter=True) or stored.drafter_sha256 or "")
            if e is not None:
                status = dataclasses.replace(
                    status, state="ready" if e.ready else "loading", bytes=e.bytes,
                    measured_weight_bytes=e.measured_weights, load_active_delta_bytes=e.active_delta,
                    active_jobs=e.in_use, idle_s=round(now - e.last_used, 3) if e.ready and not e.in_use else 0.0,
                    load_seconds=round(e.lm.load_seconds, 3) if e.lm is not None else None,
                    speculation=e.lm.spec_profile.as_dict() if e.lm is not None and e.lm.spec_profile else None,
                    speculation_profile=self._profiles.origin(mid, e.lm), **self._keeping(e, now),
                    **e.drafter_status())
            out.append(dataclasses.replace(status, pinned=stored.pin))
        return out

    def _keeping(self, e: ResidentModel, now: float) -> dict:
        """How long the model stays: its idle allowance, and when (unix time) it unloads if nothing uses it."""
        keep = e.keep_s(self._idle_timeout)
        idle = e.ready and not e.in_use
        at = time.time() + max(0.0, e.last_used + keep - now) if keep is not None and idle else None
        return {"keep_alive_s": keep, "unload_at": None if at is None else round(at, 3)}

    def close(self, finish_measuring: bool = False) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._profiles.close(self.profiler, finish_measuring)

    # --- engine thread ------------------------------------------------------------

    def request(self, name: str) -> LoadedModel | concurrent.futures.Future:
        """The loaded model, or the future of its (single, shared) load."""
        model_id = self.catalog.canonical_id(name)
        with self._lock:
            e = self._entries.get(model_id)
            if e is not None:
                return e.lm if e.ready else e.future
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._entries[model_id] = ResidentModel(self.catalog.stored(model_id), future, last_used=time.monotonic())
            self.loads_started += 1
        self._loader.submit(self._load, model_id, future)
        return future

    def acquire(self, model_id: str) -> LoadedModel | None:
        """Hold a resident model (no eviction until `release`); None if it is not resident (any more)."""
        with self._lock:
            e = self._entries.get(model_id)
            if e is None or not e.ready:
                return None
            e.in_use += 1
            e.last_used = time.monotonic()
            return e.lm

    def release(self, model_id: str) -> None:
        with self._lock:
            e = self._entries.get(model_id)
            if e is not None:
                e.in_use -= 1
                e.last_used = time.monotonic()

    def job_kv_bytes(self, model_id: str, tokens: int) -> int:
        """KV of one job of `tokens` (prompt + max_tokens) running alone on the model."""
        kv = self.kv_shape(model_id)
        return plain_batch_bytes([tokens], kv) if kv is not None else 0

    def kv_shape(self, model_id: str) -> KVShape | None:
        with self._lock:
            e = self._entries.get(model_id)
            return e.footprint.kv_shape if e is not None and e.footprint is not None else None

    def admit_batch(self, model_id: str, booked: int) -> JobAdmission:
        """Admit a job whose batch on `model_id` will hold `booked` bytes of KV with it (memory.batch_kv), evicting
        idle models if that makes it fit; on admission the model's booking is `booked`. The caller trims its
        prefix caches to `prefix_keep`, and books again (`book`) whenever rows leave."""
        with self._lock:
            needed = max(0, booked - self._batch_kv.get(model_id, 0))
            residents = [e.resident(self._idle_timeout) for e in self._entries.values()]
            plan = plan_job(needed, self.budget.usable, residents, model_id, sum(self._batch_kv.values()),
                            self.prefix_bytes, unaccounted=self._unaccounted_locked() + self.responses_bytes)
            if plan.decision == ADMIT:
                for victim in plan.evict:
                    self._unload_locked(victim, "make_room_for_job")
                self._batch_kv[model_id] = max(booked, self._batch_kv.get(model_id, 0))
        if plan.evict:
            free_mlx_cache()
        return plan

    def book(self, model_id: str, booked: int) -> None:
        """What the model's batches will hold now that rows joined or left (0: none)."""
        with self._lock:
            if booked > 0:
                self._batch_kv[model_id] = booked
            else:
                self._batch_kv.pop(model_id, None)

    def unload_idle(self) -> list[str]:
        with self._lock:
            gone = idle_to_unload([e.resident(self._idle_timeout) for e in self._entries.values()], time.monotonic())
            for mid in gone:
                self._unload_locked(mid, "idle_timeout")
        return gone  # the engine drops their prefix caches, then gives the memory back (give_back)

    def keep(self, model_id: str, seconds: float | None, *, reset: bool = False) -> None:
        """What a request or a load asked of how long the model stays idle (Ollama's keep_alive; FOREVER to keep
        it): it holds until another asks otherwise. None leaves it as it is, or with `reset` goes back to the
        settings' (a load that asks nothing)."""
        if seconds is None and not reset:
            return
        with self._lock:
            e = self._entries.get(model_id)
            if e is not None:
                e.asked_keep_s = seconds

    def unload(self, model_id: str) -> str:
        """Unload a model now (`unloaded`), or once its jobs and its load end (`unloading`); a pinned one is
        refused. A job that asks for it afterwards loads it again."""
        with self._lock:
            e = self._entries.get(model_id)
            if e is None:
                return "not_loaded"
            if e.stored.pin:
                raise JobError(Cause.INVALID_REQUEST, f"{model_id} is pinned (pin = true in its [models.{model_id}] "
                               "table): it stays loaded; unpin it in the config to let it go", param="model")
            if not e.ready or e.in_use:
                e.asked_keep_s = 0.0
                return "unloading"
            self._unload_locked(model_id, "asked")
        return "unloaded"  # as unload_idle's

    @staticmethod
    def give_back() -> None:
        """Once unloaded models' prefix caches are dropped too: their memory back to the system."""
        free_mlx_cache()

    # --- loader thread ------------------------------------------------------------

    def _load(self, model_id: str, future: concurrent.futures.Future) -> None:
        try:
            lm = self._load_admitted(model_id)
        except BaseException as e:
            with self._lock:
                self._entries.pop(model_id, None)
            if not isinstance(e, JobError):
                log.exception("model_load_crashed", model=model_id)
                e = JobError(Cause.MODEL_LOAD_FAILED, f"loading {model_id} failed: {type(e).__name__}: {e}")
            future.set_exception(e)
            return
        future.set_result(lm)

    def _load_admitted(self, model_id: str) -> LoadedModel:
        stored = self.catalog.stored(model_id)
        path, config = self.catalog.checkpoint(model_id)
        needs = load_needs(stored, path, config, kv_tokens=self._kv_tokens,
                           prefill_step=self._prefill_step, ranks=self._ranks, k=self.speculation.k,
                           kv_bits=self._kv_bits, kv_group_size=self._kv_group_size)
        fp, kind, drafter_path, drafter_need = needs.footprint, needs.kind, needs.drafter_path, needs.drafter_bytes
        with self._lock:
            entry = self._entries[model_id]
            others = [e.resident(self._idle_timeout) for mid, e in self._entries.items() if mid != model_id]
            in_flight = sum(self._batch_kv.values()) + self.prefix_bytes + self._unaccounted_locked() \
                + self.responses_bytes
            plan = plan_load(fp.total, max(0, self.budget.usable - in_flight), others, self._max_resident)
            if not plan.admit:
                log.warning("model_load_refused", model=model_id, needed=plan.needed, free=plan.free,
                            budget=plan.budget, reason=plan.reason)
                raise JobError(Cause.INSUFFICIENT_MEMORY, plan.message(model_id))
            for victim in plan.evict:
                self._unload_locked(victim, "make_room")
            entry.footprint = fp
            # After the target, and after what running jobs and the prefix caches hold: a drafter must fit now.
            headroom = self.budget.usable - sum(e.bytes for e in self._entries.values()) - in_flight
            drafting = plan_drafter(needs.caps, self.speculation.policy, drafter_need, headroom)
            if self.group is not None:  # on rank 0 alone: a kind that reads only what rank 0 holds whole
                drafting = plan_group_drafter(drafting, self.speculation.policy, bool(kind and kind.group_drafts))
            if drafting.mode is not None:
                entry.drafter_bytes = drafter_need  # reserved before any drafter weights are read
        if plan.evict:
            free_mlx_cache()
        if drafting.reason == SpecReason.INSUFFICIENT_HEADROOM:
            log.info("drafter_skipped", model=model_id, needed=drafter_need, free=headroom, reason=drafting.reason)
        lm, active_delta = loader.load_pair(model_id, path, drafter_path if drafting.mode else None, drafting,
                                            self.group, self.group_split)
        lm.kv_shape, lm.act_shape, lm.act_reserve = fp.kv_shape, fp.act_shape, fp.activations
        lm.kv_quant, lm.identity = needs.kv_quant, manifest.quick_identity(path)
        if lm.drafter is not None and self.profiler is not None and self.speculation.policy is Policy.AUTO:
            self._profiles.at_load(model_id, lm, path, drafter_path, self.profiler)  # kept, or measured meanwhile
        # Never account for less than the parameters hold (concurrent frees can hide part of the delta).
        measured = max(active_delta, loader.parameter_bytes(lm))
        with self._lock:
            entry.measured_weights, entry.active_delta = measured, active_delta
            held = held_bytes(lm.drafter_lm_head) - needs.whole_head  # a group's whole LM head as read, not guessed
            entry.drafter_bytes = 0 if lm.drafter is None else entry.drafter_bytes + held
            entry.lm = lm
            entry.last_used = time.monotonic()
        log.info("model_loaded", model=model_id, seconds=round(lm.load_seconds, 3), estimated_weight_bytes=fp.weights,
                 drafter=lm.drafter_mode, speculation_reason=lm.drafter_reason, measured_weight_bytes=measured,
                 active_delta_bytes=active_delta, reserved_bytes=entry.bytes, evicted=list(plan.evict))
        return lm

    def _unload_locked(self, model_id: str, why: str) -> None:
        e = self._entries.pop(model_id, None)
        if e is not None:
            self.evictions += 1
            log.info("model_unloaded", model=model_id, reason=why, bytes=e.bytes)
