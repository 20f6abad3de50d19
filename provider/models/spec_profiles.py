"""The residency's part in speculation profiles: at a pair's load, auto's costs from the kept profile
(models.profile_store) when one holds for this pair and machine; else the pair serves at once, auto decoding
plain (`profile_pending`), and its costs are measured on a thread of their own and kept for the next load.

`origin` is what the status says of a model's profile: a kept file's (`source` file, `measured_at`, `file`,
`stale`), a fresh measurement's (`source` measured), or `source` measuring; `measuring` also marks a stale
file being measured again.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Callable

from .. import logs
from ..speculation import MeasurementStopped
from . import profile_store
from .loader import LoadedModel

log = logs.get("models")

Origin = dict | None


class SpecProfiles:
    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spec-profiler")
        self._lock = threading.Lock()
        self._origins: dict[str, tuple[LoadedModel, Origin]] = {}  # by model id, of the pair loaded
        self.measured = 0

    def at_load(self, model_id: str, lm: LoadedModel, path: Path, drafter_path: Path | None,
                profiler: Callable) -> None:
        """Set the pair's kept profile when one holds; else let it serve with a stale one or none (auto plain)
        and measure it on the profiler thread meanwhile."""
        key = self._key(model_id, lm, path, drafter_path, getattr(profiler, "settings", {}))
        found = profile_store.read(self._dir(), key) if key is not None else profile_store.Read(None)
        if found.profile is not None:
            lm.spec_profile = found.profile
            self._set(model_id, lm, found.profile.origin.as_dict() | ({"stale": True} if found.stale else {}))
            if not found.stale:
                return
        elif key is None:
            return
        else:
            lm.profile_pending = True
            self._set(model_id, lm, {"source": profile_store.SOURCE_MEASURING, "why": found.why})
        self._pool.submit(self._measure, model_id, lm, key, profiler)

    def origin(self, model_id: str, lm: LoadedModel | None) -> Origin:
        with self._lock:
            held, origin = self._origins.get(model_id, (None, None))
        return origin if held is lm and lm is not None else None

    def close(self, profiler: Callable | None, finish_measuring: bool) -> None:
        """Wait for a measurement under way: to its end when `finish_measuring` (a one-shot `generate` keeps it,
        paying for it at exit once per machine), else to its profiler's next step (a daemon stops at once, a
        Ctrl-C seconds after its start included; nothing is kept and the next load measures)."""
        if not finish_measuring and hasattr(profiler, "stop"):
            profiler.stop()
        self._pool.shutdown(wait=True, cancel_futures=not finish_measuring)  # queued ones never start

    def _set(self, model_id: str, lm: LoadedModel, origin: Origin) -> None:
        with self._lock:
            self._origins[model_id] = (lm, origin)

    def _measure(self, model_id: str, lm: LoadedModel, key: dict, profiler: Callable) -> None:
        """Measure while the pair serves, keep the file, then let auto use it. Not held against eviction: a job
        that needs the room evicts the model as ever, and its weights are freed when the measurement ends (MLX's
        own count, which admission reads, holds them meanwhile)."""
        before = self.origin(model_id, lm)  # a stale file's, served meanwhile, or the measuring placeholder
        self._set(model_id, lm, (before or {"source": profile_store.SOURCE_MEASURING}) | {"measuring": True})
        origin = None
        try:
            measured_at = time.time()
            measured = profiler(lm)
            self.measured += 1
            try:
                file = str(profile_store.write(self._dir(), key, measured, measured_at))
            except OSError as err:
                file = ""
                log.warning("speculation_profile_not_kept", model=model_id, error=str(err))
            kept = profile_store.KeptProfile.of(measured, profile_store.Origin(profile_store.SOURCE_MEASURED,
                                                                               measured_at, file))
            lm.spec_profile = kept  # one reference swap: the engine's next plan reads it
            origin = kept.origin.as_dict()
            log.info("speculation_profile_measured", model=model_id, seconds=round(time.time() - measured_at, 3),
                     file=file)
        except MeasurementStopped:
            log.info("speculation_profile_stopped", model=model_id, seconds=round(time.time() - measured_at, 3))
        except Exception:  # without a profile, auto uses the configured k
            log.exception("speculation_profile_failed", model=model_id)
        finally:
            lm.profile_pending = False
            kept_before = before if before and before["source"] != profile_store.SOURCE_MEASURING else None
            self._set(model_id, lm, origin or kept_before)

    def _key(self, model_id: str, lm: LoadedModel, path: Path, drafter_path: Path | None,
             settings: dict) -> dict | None:
        """`settings`: how the profiler times a step (engine.profile.Profiler's); a change measures again."""
        try:
            # A step's cost depends on the KV's precision too (quantized attention costs more on a CPU).
            measure = settings | ({"kv_quant": [lm.kv_quant.bits, lm.kv_quant.group_size]} if lm.kv_quant else {})
            return profile_store.pair_key(profile_store.weights_hash(path), profile_store.weights_hash(drafter_path),
                                          lm.drafter_mode, measure)
        except OSError as e:
            log.warning("speculation_profile_unkeyed", model=model_id, error=str(e))
            return None

    @staticmethod
    def _dir() -> Path:
        return profile_store.default_dir()  # read when used: tests move XDG_STATE_HOME
