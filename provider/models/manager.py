"""The resident set under a memory budget: models load on first use and idle ones are evicted.

Loads run on one loader thread, so the engine keeps decoding other models
meanwhile; every job that wants a model still loading waits on the same
future (one load). Admission is decided by `memory.admission.plan_load` from
file-only estimates; after a load the measured size replaces the estimate.
The engine thread is the only caller of `request`/`acquire`/`release`; other
threads may read `snapshot`/`memory`.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import logs
from ..jobs import Cause, JobError
from ..memory import estimate
from ..memory.admission import Resident, idle_to_unload, plan_load
from ..memory.budget import Budget
from ..speculation import INSUFFICIENT_HEADROOM, NO_DRAFTER, SpecMode, SpeculationConfig, plan_drafter
from . import loader, manifest
from .loader import LoadedModel
from .store import StoredModel

log = logs.get("models")


@dataclass(frozen=True)
class Footprint:
    weights: int
    kv: int  # one sequence of kv_reserve_tokens (sliding layers capped at their window)
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations


def estimate_footprint(path: Path, config: dict, *, kv_tokens: int, prefill_step: int) -> Footprint:
    tensors = estimate.tensor_names(path)  # the headers, read once
    weights = estimate.weight_bytes(path, config, tensors)
    dtype_bytes = _dominant_float_bytes(tensors)
    tokens = min(kv_tokens, loader.context_length(config))
    return Footprint(weights, estimate.kv_shape(config, dtype_bytes).bytes_for(tokens),
                     estimate.activation_bytes(config, prefill_step))


def _dominant_float_bytes(tensors: dict) -> int:
    sizes: dict[int, int] = {}
    for dtype, _shape in tensors.values():
        if dtype in ("F32", "F16", "BF16"):
            n = estimate.DTYPE_BYTES[dtype]
            sizes[n] = sizes.get(n, 0) + 1
    return max(sizes, key=sizes.get) if sizes else 2


@dataclass
class _Entry:
    stored: StoredModel
    future: concurrent.futures.Future
    footprint: Footprint | None = None
    lm: LoadedModel | None = None
    measured_weights: int | None = None
    drafter_bytes: int = 0
    active_delta: int | None = None  # raw mx.get_active_memory() growth across the load
    in_use: int = 0
    last_used: float = 0.0

    @property
    def ready(self) -> bool:
        return self.lm is not None

    @property
    def bytes(self) -> int:
        if self.footprint is None:
            return 0
        weights = max(self.measured_weights or 0, self.footprint.weights)
        return weights + self.footprint.kv + self.footprint.activations + self.drafter_bytes

    def resident(self) -> Resident:
        return Resident(self.stored.id, self.bytes, busy=not self.ready or self.in_use > 0, last_used=self.last_used)


class ModelManager:
    def __init__(self, models: list[StoredModel], budget: Budget, *, max_resident: int = 2,
                 idle_timeout: float = 0.0, kv_reserve_tokens: int = 4096, prefill_step: int = 2048,
                 default_id: str | None = None, allow_download: bool = True,
                 speculation: SpeculationConfig = SpeculationConfig()):
        self._catalog = {m.id: m for m in models}
        self.default_id = default_id or next(iter(self._catalog), None)
        self.budget = budget
        self._max_resident = max_resident
        self._idle_timeout = idle_timeout
        self._kv_tokens = kv_reserve_tokens
        self._prefill_step = prefill_step
        self._allow_download = allow_download
        self.speculation = speculation  # the node's one owner of policy and k; the engine reads it here
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-loader")
        self.loads_started = 0
        self.evictions = 0

    # --- any thread ---------------------------------------------------------------

    def ids(self) -> list[str]:
        return list(self._catalog)

    def stored(self, model_id: str) -> StoredModel:
        return self._catalog[model_id]

    def canonical_id(self, name: str | None) -> str:
        """Map a requested model name (id, source, or empty for the default) to a known id."""
        if not name:
            if self.default_id is None:
                raise JobError(Cause.UNKNOWN_MODEL, "no model is configured on this node")
            return self.default_id
        if name in self._catalog:
            return name
        for mid, m in self._catalog.items():
            if name == m.source:
                return mid
        raise JobError(Cause.UNKNOWN_MODEL, f"model {name!r} is not served here; available: {', '.join(self._catalog)}")

    def checkpoint(self, model_id: str) -> tuple[Path, dict]:
        """The model's directory and config (downloading it if it is a repo id not yet cached)."""
        stored = self._catalog[model_id]
        path = stored.path or loader.resolve(stored.source, allow_download=self._allow_download)
        return path, loader.read_config(path)

    def resident(self) -> list[str]:
        with self._lock:
            return [mid for mid, e in self._entries.items() if e.ready]

    def snapshot(self) -> list[dict]:
        with self._lock:
            now = time.monotonic()
            return [{"id": mid, "state": "ready" if e.ready else "loading", "bytes": e.bytes,
                     "measured_weight_bytes": e.measured_weights, "load_active_delta_bytes": e.active_delta,
                     "active_jobs": e.in_use,
                     "idle_s": round(now - e.last_used, 3) if e.ready and not e.in_use else 0.0}
                    for mid, e in self._entries.items()]

    def memory(self) -> dict:
        import mlx.core as mx

        with self._lock:
            used = sum(e.bytes for e in self._entries.values())
        return self.budget.as_dict() | {"reserved_bytes": used, "free_bytes": max(0, self.budget.usable - used),
                                        "mlx_active_bytes": mx.get_active_memory(),
                                        "mlx_peak_bytes": mx.get_peak_memory()}

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)

    # --- engine thread ------------------------------------------------------------

    def request(self, name: str) -> LoadedModel | concurrent.futures.Future:
        """The loaded model, or the future of its (single, shared) load."""
        model_id = self.canonical_id(name)
        with self._lock:
            e = self._entries.get(model_id)
            if e is not None:
                return e.lm if e.ready else e.future
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._entries[model_id] = _Entry(self._catalog[model_id], future, last_used=time.monotonic())
            self.loads_started += 1
        self._loader.submit(self._load, model_id, future)
        return future

    def acquire(self, model_id: str) -> LoadedModel:
        with self._lock:
            e = self._entries.get(model_id)
            if e is None or not e.ready:
                raise JobError(Cause.INTERNAL, f"model {model_id} is not resident")
            e.in_use += 1
            e.last_used = time.monotonic()
            return e.lm

    def release(self, model_id: str) -> None:
        with self._lock:
            e = self._entries.get(model_id)
            if e is not None:
                e.in_use -= 1
                e.last_used = time.monotonic()

    def unload_idle(self) -> list[str]:
        with self._lock:
            gone = idle_to_unload([e.resident() for e in self._entries.values()], time.monotonic(),
                                  self._idle_timeout)
            for mid in gone:
                self._unload_locked(mid, "idle_timeout")
        if gone:
            _free_mlx_cache()
        return gone

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
        import mlx.core as mx

        stored = self._catalog[model_id]
        path, config = self.checkpoint(model_id)
        if stored.sha256:
            verify_pin(model_id, path, stored.sha256)
        try:
            fp = estimate_footprint(path, config, kv_tokens=self._kv_tokens, prefill_step=self._prefill_step)
        except (estimate.HeaderError, OSError) as e:
            raise JobError(Cause.MODEL_LOAD_FAILED, f"cannot read the weights of {model_id}: {e}") from None
        with self._lock:
            entry = self._entries[model_id]
            others = [e.resident() for mid, e in self._entries.items() if mid != model_id]
            plan = plan_load(fp.total, self.budget.usable, others, self._max_resident)
            if not plan.admit:
                log.warning("model_load_refused", model=model_id, needed=plan.needed, free=plan.free,
                            budget=plan.budget, reason=plan.reason)
                raise JobError(Cause.INSUFFICIENT_MEMORY, plan.message(model_id))
            for victim in plan.evict:
                self._unload_locked(victim, "make_room")
            entry.footprint = fp
        if plan.evict:
            _free_mlx_cache()
        gc.collect()  # so that unrelated frees during the load do not shrink the measured delta
        before = mx.get_active_memory()
        lm = loader.load(model_id, path)
        active_delta = mx.get_active_memory() - before
        # Never account for less than the parameters hold (concurrent frees can hide part of the delta).
        measured = max(active_delta, loader.parameter_bytes(lm))
        loader.warm_up(lm)
        with self._lock:
            entry.measured_weights, entry.active_delta = measured, active_delta
        self._attach_drafter(entry, lm, config)
        with self._lock:
            entry.lm = lm
            entry.last_used = time.monotonic()
        log.info("model_loaded", model=model_id, seconds=round(lm.load_seconds, 3), estimated_weight_bytes=fp.weights,
                 drafter=lm.drafter_mode, speculation_reason=lm.drafter_reason,
                 measured_weight_bytes=measured, active_delta_bytes=active_delta, reserved_bytes=entry.bytes,
                 evicted=list(plan.evict))
        return lm

    def _attach_drafter(self, entry: _Entry, lm: LoadedModel, target_config: dict) -> None:
        """Load a drafter when `plan_drafter` says so: the target can use one (config files decide, before
        any drafter weights are read), it fits the headroom after the target, and the policy is not off."""
        from . import capability

        stored = entry.stored
        drafter_path = Path(stored.drafter).expanduser() if stored.drafter else None
        caps = capability.with_drafter(capability.detect(lm.path, target_config), lm.path, drafter_path,
                                       target_config)
        if drafter_path is not None and not (caps.mtp_capable or caps.draft_compatible):
            log.warning("drafter_not_paired", model=lm.id, drafter=str(drafter_path), why=caps.drafter_reason)
        need = 0
        if caps.mtp_capable or caps.draft_compatible:
            mode = SpecMode.MTP if caps.mtp_capable else SpecMode.DRAFT
            need = drafter_footprint(drafter_path, loader.read_config(drafter_path), mode, self.speculation.k,
                                     self._prefill_step)
        with self._lock:
            free = self.budget.usable - sum(e.bytes for e in self._entries.values())
            plan = plan_drafter(caps, self.speculation.policy, need, free)
            if plan.mode is not None:
                entry.drafter_bytes = need  # reserved before the weights are read
        lm.drafter_reason = plan.reason
        if plan.mode is None:
            if plan.reason == INSUFFICIENT_HEADROOM:
                log.info("drafter_skipped", model=lm.id, needed=need, free=free, reason=plan.reason)
            return
        try:
            if plan.mode is SpecMode.MTP:
                from .gemma4_assistant import load_assistant

                lm.drafter = load_assistant(drafter_path)
            else:
                draft = loader.load(f"{lm.id}:draft", drafter_path)
                loader.warm_up(draft)  # evaluate lazily built arrays on this (loading) thread
                lm.drafter = draft.model
        except Exception as e:
            with self._lock:
                entry.drafter_bytes = 0
            lm.drafter_reason = NO_DRAFTER
            log.warning("drafter_load_failed", model=lm.id, error=f"{type(e).__name__}: {e}")
            return
        lm.drafter_mode = plan.mode

    def _unload_locked(self, model_id: str, why: str) -> None:
        e = self._entries.pop(model_id, None)
        if e is not None:
            self.evictions += 1
            log.info("model_unloaded", model=model_id, reason=why, bytes=e.bytes)


def drafter_footprint(path: Path, config: dict, mode: SpecMode, k: int, prefill_step: int) -> int:
    """Drafter weights plus its activations: the assistant works k+1 positions at a time; a draft model
    prefills the prompt like the target and keeps its own KV (counted within its activations' chunk)."""
    weights = estimate.weight_bytes(path, config)
    if mode is SpecMode.MTP:
        return weights + estimate.activation_bytes(config, k + 1)
    return weights + estimate.activation_bytes(config, prefill_step) + estimate.kv_shape(config).bytes_for(
        prefill_step)


def verify_pin(model_id: str, path: Path, pinned: str) -> None:
    actual = manifest.model_hash(manifest.manifest(path))
    if actual != pinned:
        raise JobError(Cause.MODEL_LOAD_FAILED,
                       f"{model_id}: checkpoint hash {actual[:16]}… does not match the pinned {pinned[:16]}…; "
                       "the files changed since they were pinned — re-download, or update the pin after "
                       "checking them with `provider models verify`")


def _free_mlx_cache() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
