"""Speculation profiles kept across runs: what `provider.engine.profile.measure` found for a pair, saved in the
state directory and read back at the next load, so auto decides from the first job without measuring again.

A profile holds only while everything its numbers depend on is unchanged: its `key` (the target's and the
drafter's manifest hashes, the drafter's kind, MLX's and mlx-lm's versions, the device and its memory and
cores, and how `measure` times a step). A file whose key differs from the load's, or older than `MAX_AGE_S`,
is measured again. A file is plain JSON, read only after a size check and then checked field by field: a
corrupt or foreign one is ignored with a log line (never unpickled, never partly used).

One file per pair of weights (named by their hashes), rewritten atomically, 0600.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from .. import logs, paths
from ..types import SpecMode
from ..speculation import GREEDY, SPECULATIVE_SAMPLING, KChoice, SpecCosts, SpecProfile

log = logs.get("profile_store")

FORMAT = 1
DIR_NAME = "speculation"
MAX_BYTES = 64 << 10  # a profile is well under 2 KiB: anything larger is not one
MAX_AGE_S = 30 * 86400  # a month: drivers, thermal paste and background load drift; measuring again is cheap
MAX_K = 16
MAX_ROWS = 256
SOURCE_FILE, SOURCE_MEASURED, SOURCE_MEASURING = "file", "measured", "measuring"


@dataclass(frozen=True)
class Origin:
    """Where a served profile came from: measured in this process, or read from `file`; measured at `measured_at`
    (Unix time) either way."""

    source: str
    measured_at: float
    file: str = ""

    def as_dict(self) -> dict:
        return {"source": self.source, "measured_at": _iso(self.measured_at), "file": self.file}


@dataclass(frozen=True)
class SourcedChoice(KChoice):
    """Auto's decision, with where the costs it was made from came from (telemetry says so)."""

    origin: Origin | None = None


class KeptProfile(SpecProfile):
    """A SpecProfile that knows its origin: its decisions carry it into each job's telemetry."""

    def __init__(self, costs: SpecCosts, acceptance: dict[str, float], origin: Origin):
        super().__init__(costs, acceptance)
        self.origin = origin
        self.first_acceptance = dict(acceptance)  # as measured: what is saved (serving moves `acceptance` on)

    @classmethod
    def of(cls, profile: SpecProfile, origin: Origin) -> "KeptProfile":
        return cls(profile.costs, {scheme: a.rate for scheme, a in profile.acceptance.items()}, origin)

    def decide(self, scheme: str, rows: int = 1) -> KChoice:
        c = super().decide(scheme, rows)
        return SourcedChoice(c.k, c.speedup, c.acceptance, c.speedups, self.origin)

    def as_dict(self) -> dict:
        return super().as_dict() | {"profile": self.origin.as_dict()}


# --- the key ------------------------------------------------------------------------------------------------


def machine_key() -> dict:
    """The versions and the device a step's time depends on."""
    import mlx.core as mx
    import mlx_lm

    from ..memory.budget import system_facts

    facts = system_facts()
    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "backend": facts.backend,
            "device": facts.device or _cpu_model(), "machine": platform.machine(), "memory_bytes": facts.total_memory,
            "cpu_cores": os.cpu_count() or 0}


def pair_key(target_hash: str, drafter_hash: str, drafter_mode: str, measure: dict) -> dict:
    """Everything a pair's profile depends on: its weights, the drafter's kind, this machine (`machine_key`) and
    how `measure` times a step (`measure`: its constants)."""
    return {"format": FORMAT, "target": target_hash, "drafter": drafter_hash, "drafter_mode": SpecMode(drafter_mode).value,
            **machine_key(), "measure": dict(measure)}


def weights_hash(path: Path | None) -> str:
    """A checkpoint's manifest hash (per-file hashes cached by size and mtime: read once per machine)."""
    from . import manifest

    if path is None:
        return ""
    return manifest.model_hash(manifest.manifest(path))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --- the files ----------------------------------------------------------------------------------------------


def default_dir() -> Path:
    return paths.state_dir() / DIR_NAME


def file_for(directory: Path, key: dict) -> Path:
    """One file per pair of weights: a new MLX or device rewrites it; new weights get their own."""
    name = hashlib.sha256(f"{key['target']} {key['drafter']} {key['drafter_mode']}".encode()).hexdigest()[:24]
    return directory / f"{name}.json"


@dataclass(frozen=True)
class Read:
    """What a load found: a usable profile (`profile`), one too old to trust but better than none until the
    new one is measured (`stale`), or nothing (`why`: missing, a different key, corrupt, foreign)."""

    profile: KeptProfile | None
    stale: bool = False
    why: str = ""


def read(directory: Path, key: dict, *, now: float | None = None) -> Read:
    path = file_for(directory, key)
    now = time.time() if now is None else now
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            return _ignored(path, f"{size} bytes, larger than any profile")
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        return Read(None, why="missing")
    except (OSError, ValueError, RecursionError) as e:
        return _ignored(path, f"not JSON ({type(e).__name__})")
    try:
        costs, acceptance, measured_at, their_key = parse(body)
    except ValueError as e:
        return _ignored(path, str(e))
    if their_key != key:
        changed = sorted(k for k in set(key) | set(their_key) if key.get(k) != their_key.get(k))
        log.info("speculation_profile_key_changed", file=str(path), changed=changed)
        return Read(None, why="key changed: " + ", ".join(changed))
    profile = KeptProfile(costs, acceptance, Origin(SOURCE_FILE, measured_at, str(path)))
    if not 0 <= now - measured_at <= MAX_AGE_S:
        log.info("speculation_profile_stale", file=str(path), measured_at=_iso(measured_at))
        return Read(profile, stale=True, why="stale")
    return Read(profile)


def write(directory: Path, key: dict, profile: SpecProfile, measured_at: float) -> Path:
    """Atomically (a reader never sees half a file), 0600."""
    rates = profile.first_acceptance if isinstance(profile, KeptProfile) else \
        {scheme: a.rate for scheme, a in profile.acceptance.items()}
    c = profile.costs
    body = {"format": FORMAT, "key": key, "measured_at": measured_at,
            "costs": {"plain_token_s": c.plain_token_s, "round_s": list(c.round_s), "rows": c.rows,
                      "plain_rows_s": c.plain_rows_s, "round_rows_s": list(c.round_rows_s)},
            "acceptance": rates}
    path = file_for(directory, key)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    paths.write_private(tmp, json.dumps(body, indent=1, sort_keys=True).encode())
    os.replace(tmp, path)
    return path


def parse(body) -> tuple[SpecCosts, dict[str, float], float, dict]:
    """A profile file's body, checked field by field: ValueError says what is wrong."""
    _fields(body, {"format", "key", "measured_at", "costs", "acceptance"}, "the file")
    if body["format"] != FORMAT:
        raise ValueError(f"format {body['format']!r}, not {FORMAT}")
    key = body["key"]
    if not isinstance(key, dict) or not all(isinstance(k, str) for k in key):
        raise ValueError("key is not an object")
    measured_at = _number(body["measured_at"], "measured_at", 0.0, 1e11)
    c = body["costs"]
    _fields(c, {"plain_token_s", "round_s", "rows", "plain_rows_s", "round_rows_s"}, "costs")
    plain = _number(c["plain_token_s"], "plain_token_s", 1e-9, 3600.0)
    rounds = _times(c["round_s"], "round_s", 1)
    rows = c["rows"]
    if type(rows) is not int or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows {rows!r} is not an integer in 1..{MAX_ROWS}")
    plain_rows = _number(c["plain_rows_s"], "plain_rows_s", 0.0, 3600.0)
    rounds_rows = _times(c["round_rows_s"], "round_rows_s", 0)
    if rounds_rows and len(rounds_rows) != len(rounds):
        raise ValueError("round_rows_s and round_s differ in length")
    a = body["acceptance"]
    _fields(a, {GREEDY, SPECULATIVE_SAMPLING}, "acceptance")
    acceptance = {scheme: _number(a[scheme], f"acceptance {scheme}", 0.0, 1.0) for scheme in (GREEDY,
                                                                                            SPECULATIVE_SAMPLING)}
    return SpecCosts(plain, rounds, rows, plain_rows, rounds_rows), acceptance, measured_at, key


def _fields(obj, names: set[str], what: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not an object")
    if set(obj) != names:
        raise ValueError(f"{what} has fields {sorted(obj)}, not {sorted(names)}")


def _number(x, what: str, lo: float, hi: float) -> float:
    if type(x) not in (int, float) or not math.isfinite(x) or not lo <= x <= hi:
        raise ValueError(f"{what} {x!r} is not a number in [{lo}, {hi}]")
    return float(x)


def _times(xs, what: str, least: int) -> tuple[float, ...]:
    if not isinstance(xs, list) or not least <= len(xs) <= MAX_K:
        raise ValueError(f"{what} is not a list of {least}..{MAX_K} times")
    return tuple(_number(x, what, 1e-9, 3600.0) for x in xs)


def _ignored(path: Path, why: str) -> Read:
    log.warning("speculation_profile_ignored", file=str(path), why=why)
    return Read(None, why=f"ignored: {why}")


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
