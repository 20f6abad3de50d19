"""One frozen Settings object: defaults, then the TOML file, then PROVIDER_* env, then CLI flags.

Every value is type- and bounds-checked once at start-up; a bad value raises
SettingsError naming the key, where it came from, and what is allowed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import paths

ENV_PREFIX = "PROVIDER_"


class SettingsError(ValueError):
    """A configuration value is missing, malformed or out of range."""


def _range(lo: float | None = None, hi: float | None = None) -> dict:
    return {"lo": lo, "hi": hi}


def _choice(*options: str | int) -> dict:
    return {"choices": options}


def _listed(ok, what: str) -> dict:
    """A comma-separated list whose every entry must pass `ok` (else: it is not `what`)."""
    return {"check": lambda value: next((f"{e[:80]!r} is not {what}" for e in _split(value) if not ok(e)), None)}


def _split(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*")
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:[0-9]{1,5})?")


def host_name(raw: str) -> str | None:
    """`raw` as the local API compares Host names (lowercase, no trailing dot, IPv6 without brackets), or None if
    it is not a host name or IP address."""
    name = raw.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name if len(name) <= 253 and _NAME.fullmatch(name) else None


KV_BITS = (0, 4, 8)  # 0: full-precision KV; 4 or 8: quantized as mlx-lm's QuantizedKVCache stores it
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class ModelSpec:
    """One `[models.<id>]` table: a model this node serves, optionally pinned and paired."""

    id: str
    source: str  # directory or Hugging Face repo id
    sha256: str = ""  # pinned checkpoint hash (`provider models verify` prints it); a mismatch refuses the load
    drafter: str = ""  # Gemma 4 assistant or same-vocabulary draft model for speculation
    drafter_sha256: str = ""  # pinned hash of the drafter's files; a mismatch refuses the load
    # Residency (docs/memory.md): a pinned model loads at start and is never unloaded; idle_timeout_s overrides
    # the node's (None: the node's; 0: never by idleness).
    pin: bool = False
    idle_timeout_s: float | None = None
    # KV cache precision (None: the node's kv_bits / kv_group_size).
    kv_bits: int | None = None
    kv_group_size: int | None = None

    @classmethod
    def parse(cls, model_id: str, raw: Any, source: str) -> "ModelSpec":
        where = f"{source}: models.{model_id}"
        if not isinstance(raw, dict):
            raise SettingsError(f"{where} must be a table with at least `source`")
        allowed = ("source", "sha256", "drafter", "drafter_sha256", "pin", "idle_timeout_s", "kv_bits",
                   "kv_group_size")
        unknown = set(raw) - set(allowed)
        if unknown:
            raise SettingsError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(allowed)}")
        if not isinstance(raw.get("source"), str) or not raw["source"]:
            raise SettingsError(f"{where}.source must be a non-empty string (a directory or repo id)")
        pins = {}
        for key in ("sha256", "drafter_sha256"):
            pins[key] = raw.get(key, "")
            if pins[key] and not (isinstance(pins[key], str) and re.fullmatch(r"[0-9a-f]{64}", pins[key])):
                raise SettingsError(f"{where}.{key} must be 64 lowercase hex digits")
        drafter = raw.get("drafter", "")
        if not isinstance(drafter, str):
            raise SettingsError(f"{where}.drafter must be a string")
        if pins["drafter_sha256"] and not drafter:
            raise SettingsError(f"{where}.drafter_sha256 pins a drafter, so {where}.drafter must name it")
        pin = raw.get("pin", False)
        if not isinstance(pin, bool):
            raise SettingsError(f"{where}.pin must be true or false")
        ttl = raw.get("idle_timeout_s")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl <= 7 * 86400):
            raise SettingsError(f"{where}.idle_timeout_s must be seconds from 0 (never) to {7 * 86400}")
        kv_bits, group = raw.get("kv_bits"), raw.get("kv_group_size")
        if kv_bits is not None and (isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
            raise SettingsError(f"{where}.kv_bits must be one of {', '.join(map(str, KV_BITS))}")
        if group is not None and (isinstance(group, bool) or group not in KV_GROUP_SIZES):
            raise SettingsError(f"{where}.kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}")
        return cls(model_id, raw["source"], pins["sha256"], drafter, pins["drafter_sha256"], pin,
                   None if ttl is None else float(ttl), kv_bits, group)


@dataclass(frozen=True)
class Settings:
    # Model served when a request or job does not name one; empty means the bundled default.
    model: str = ""
    # Draft model or Gemma 4 assistant paired with `model` (used by speculation).
    drafter: str = ""
    speculation: str = field(default="auto", metadata=_choice("auto", "on", "off"))
    speculation_k: int = field(default=3, metadata=_range(1, 16))  # draft tokens per round
    # Under auto, a job speculates (verified in one batch with the model's other speculating jobs) only while
    # its model runs at most this many jobs; past it, new jobs decode in the plain batch (batch_too_large).
    speculation_max_batch: int = field(default=8, metadata=_range(1, 256))

    # Local OpenAI-compatible API.
    bind: str = "127.0.0.1"
    port: int = field(default=8080, metadata=_range(0, 65535))
    local: bool = False  # serve the local OpenAI-compatible API (as --local does); a service sets it in the config
    auth: bool = True
    # Serving without a token on a non-loopback address is refused unless this says it is meant.
    allow_unauthenticated_public: bool = False
    # Browser origins allowed to call the local API (comma-separated, e.g. "http://localhost:3000"); none by default.
    # Every request that carries another Origin is refused, on every method (provider/local/origin_guard.py).
    cors_origins: str = field(default="", metadata=_listed(lambda e: _ORIGIN.fullmatch(e.lower().rstrip("/")),
                                                           "an origin: scheme://host[:port] (no path, * or null)"))
    # Names the local API answers to besides its own addresses (comma-separated host names or IPs, no port, e.g.
    # "mymac.lan"): a request whose Host names anything else is refused (DNS rebinding).
    allowed_hosts: str = field(default="", metadata=_listed(host_name, "a host name or IP (no scheme, port or *)"))
    metrics_public: bool = False  # serve GET /metrics without the bearer token (for a scraper on a private network)
    max_body_bytes: int = field(default=20 * 2**20, metadata=_range(1024, 256 * 2**20))  # room for inline images
    # Frames waiting for a coordinator that does not read: past this, the node stops reading its frames, and
    # after coordinator_outbox_stall_s over it ends the session (docs/protocol.md).
    coordinator_outbox_bytes: int = field(default=32 * 2**20, metadata=_range(64 * 1024, 2**30))
    coordinator_outbox_stall_s: float = field(default=10.0, metadata=_range(1.0, 600.0))

    # Coordinator session.
    coordinator: str = ""
    coordinator_ca_file: str = ""
    allow_insecure_coordinator: bool = False
    # Refuse coordinator jobs whose body is not sealed to this process's key (SEALING_FAILED), never run them.
    require_sealed_jobs: bool = False
    heartbeat_interval_s: float = field(default=5.0, metadata=_range(0.1, 300))
    reconnect_base_delay_s: float = field(default=0.5, metadata=_range(0.01, 60))
    reconnect_max_delay_s: float = field(default=30.0, metadata=_range(0.05, 3600))
    # A session that stayed up this long counts as healthy and resets the reconnect backoff.
    healthy_session_s: float = field(default=10.0, metadata=_range(0, 3600))

    # Engine.
    # Jobs decoding at once (one batch per model); each is also admitted only if its KV fits the memory budget.
    max_concurrent_jobs: int = field(default=32, metadata=_range(1, 256))
    max_queued_jobs: int = field(default=256, metadata=_range(0, 100_000))
    max_tokens_limit: int = field(default=32768, metadata=_range(1, 1 << 20))
    default_max_tokens: int = field(default=1024, metadata=_range(1, 1 << 20))
    # Prompt tokens one engine step reads (half of it, plus 4 a row, beside decoding rows: engine.prefill_plan);
    # 0: by device, 128 on a CPU, 512 on a GPU.
    prefill_step_size: int = field(default=0, metadata=_range(0, 1 << 16))
    # KV of recent prompts kept per model for prefix reuse (dropped first when the budget needs room); 0: off.
    prefix_cache_gb: float = field(default=1.0, metadata=_range(0, 4096))
    # Its disk tier (docs/memory.md): long prompts' KV kept in files that outlive the process, read back before a
    # prefill that needs them. At most this much disk (and never past a tenth of the free space at start; 0: off),
    # written at most this fast (docs/memory.md says why these defaults), in prefix_disk_dir (default:
    # $XDG_CACHE_HOME/provider/prefix-cache).
    prefix_disk_gb: float = field(default=8.0, metadata=_range(0, 1 << 20))
    prefix_disk_write_gb_per_hour: float = field(default=4.0, metadata=_range(0.01, 1024))
    prefix_disk_dir: str = ""
    # A proof in every outcome (docs/verification.md): per token, a commitment to the model's hidden state, and
    # the seed of sampled tokens. auto: on when a coordinator is set (what the network checks), else off (a local
    # server's clients have no verifier). Committing costs no decode the benchmark can see (docs/verification.md).
    commitments: str = field(default="auto", metadata=_choice("auto", "on", "off"))
    # On SIGTERM/Ctrl-C, in-flight jobs get this long to finish before they are cancelled.
    shutdown_grace_s: float = field(default=10.0, metadata=_range(0, 3600))

    # Models this node serves beyond `model` (TOML only: [models.<id>] tables).
    models: tuple[ModelSpec, ...] = ()
    models_dir: str = ""  # default: $XDG_CACHE_HOME/provider/models

    # Memory budget and resident models.
    memory_budget_gb: float = field(default=0.0, metadata=_range(0, 1 << 20))  # 0: decide from the platform
    kv_reserve_tokens: int = field(default=4096, metadata=_range(16, 1 << 22))
    memory_fraction: float = field(default=0.75, metadata=_range(0.05, 0.98))
    memory_reserve_gb: float = field(default=1.0, metadata=_range(0, 4096))
    max_resident_models: int = field(default=2, metadata=_range(1, 64))
    # A model idle this long is unloaded and its memory given back (0: never; per model in [models.<id>]; a
    # request's keep_alive overrides it for that model until the next request says otherwise).
    idle_timeout_s: float = field(default=0.0, metadata=_range(0, 7 * 86400))
    # KV cache precision for every model (per model in [models.<id>]): 0 full precision, 8 or 4 bits quantized in
    # groups of kv_group_size along the head dimension (docs/memory.md: bytes, speed and quality measured).
    kv_bits: int = field(default=0, metadata=_choice(*KV_BITS))
    kv_group_size: int = field(default=64, metadata=_choice(*KV_GROUP_SIZES))

    # Node group (docs/group.md): several machines serving one model as one provider, over MLX's distributed
    # engine. `group_hostfile` is MLX's ring hostfile (a JSON list, per rank, of "ip:port"); empty: no group,
    # unless MLX_HOSTFILE and MLX_RANK are set.
    group_hostfile: str = ""
    group_rank: int = field(default=-1, metadata=_range(-1, 1023))  # -1: MLX_RANK
    group_backend: str = field(default="ring", metadata=_choice("ring", "jaccl"))
    # How the model is split (models.loader.choose_split): auto = tensor where the family shards, else pipeline.
    group_split: str = field(default="auto", metadata=_choice("auto", "tensor", "pipeline"))
    # How long joining the group may take (every rank started and connected).
    group_timeout_s: float = field(default=60.0, metadata=_range(1, 3600))
    # How long a step may go without every rank's progress before the group is declared lost (each rank then
    # exits non-zero for its supervisor). An idle group still steps once a second, and a step reads at most one
    # prefill chunk; MLX's ring can wait without end after a peer dies, so this is what bounds that wait.
    group_step_timeout_s: float = field(default=20.0, metadata=_range(1, 3600))
    # How long a worker rank may take from joining to serving (loading its share of the model) before it gives
    # up on rank 0: a rank 0 that died or hung while the group loaded would otherwise keep it waiting for ever.
    group_load_timeout_s: float = field(default=900.0, metadata=_range(1, 86400))
    # The group's shared secret (`provider group init` writes one; copy it to every rank, 0600). Plans, the
    # rendezvous and the wake-up connections are authenticated with it. Empty: group-secret in the state dir.
    group_secret_file: str = ""
    # MLX's ring carries tensors unauthenticated: a hostfile with public addresses is refused unless this says
    # the operator knows the links are private anyway (a VPN, a dedicated switch).
    group_allow_public_network: bool = False

    # Logs.
    log_level: str = field(default="info", metadata=_choice("debug", "info", "warning", "error"))
    log_format: str = field(default="auto", metadata=_choice("auto", "console", "json"))
    # Where the node writes its own log, rotated by size (logs.LOG_FILE_MAX_BYTES, LOG_FILE_BACKUPS); empty:
    # stderr. The launchd agent sets it (PROVIDER_LOG_FILE), since launchd never rotates what it redirects.
    log_file: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "models":
                _check_bounds(f, getattr(self, f.name), "settings")
        if self.default_max_tokens > self.max_tokens_limit:
            raise SettingsError(
                f"default_max_tokens ({self.default_max_tokens}) must not exceed "
                f"max_tokens_limit ({self.max_tokens_limit})"
            )

    @property
    def cors_origin_list(self) -> tuple[str, ...]:
        return tuple(o.rstrip("/").lower() for o in _split(self.cors_origins))

    @property
    def allowed_host_names(self) -> frozenset[str]:
        """allowed_hosts as the local API compares Host names (lowercase, no brackets, no trailing dot)."""
        return frozenset(n for n in map(host_name, _split(self.allowed_hosts)) if n is not None)

    @property
    def committing(self) -> bool:
        return self.commitments == "on" or (self.commitments == "auto" and bool(self.coordinator))

    @classmethod
    def load(
        cls,
        cli: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: Path | None = None,
    ) -> "Settings":
        """Layer defaults < TOML file < PROVIDER_* environment < CLI flags (None = not given)."""
        env = os.environ if env is None else env
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}

        named = config_file or env.get(ENV_PREFIX + "CONFIG")
        path = Path(named) if named else paths.config_file()
        if named and not path.is_file():  # a file asked for by name must exist; the default one may not
            raise SettingsError(f"config file {path} does not exist (given by "
                                f"{'--config' if config_file else ENV_PREFIX + 'CONFIG'})")
        if path.exists():
            try:
                data = tomllib.loads(path.read_text())
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise SettingsError(f"cannot read config file {path}: {e}") from e
            for key, raw in data.items():
                if key not in fields:
                    raise SettingsError(f"unknown key {key!r} in {path}; known keys: {', '.join(fields)}")
                if key == "models":
                    if not isinstance(raw, dict):
                        raise SettingsError(f"{path}: models must be tables, e.g. [models.my-model]")
                    values[key] = tuple(ModelSpec.parse(mid, spec, str(path)) for mid, spec in raw.items())
                    continue
                values[key] = _coerce(fields[key], raw, f"{path}:{key}")

        for name, f in fields.items():
            if name == "models":
                continue
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _coerce(f, raw, ENV_PREFIX + name.upper())

        for name, raw in (cli or {}).items():
            if raw is None:
                continue
            if name not in fields:
                raise SettingsError(f"unknown setting {name!r}")
            values[name] = _coerce(fields[name], raw, f"--{name.replace('_', '-')}")

        return cls(**values)


def _coerce(f: dataclasses.Field, raw: Any, source: str) -> Any:
    kind = {"str": str, "int": int, "float": float, "bool": bool}[f.type]
    try:
        if kind is bool:
            if isinstance(raw, bool):
                value = raw
            elif isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on"):
                value = True
            elif isinstance(raw, str) and raw.lower() in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError(raw)
        elif kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            value = int(raw)
        elif kind is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            value = float(raw)
        else:
            if not isinstance(raw, str):
                raise ValueError(raw)
            value = raw
    except (TypeError, ValueError):
        raise SettingsError(f"{f.name} (from {source}): expected {kind.__name__}, got {raw!r}") from None
    _check_bounds(f, value, source)
    return value


def _check_bounds(f: dataclasses.Field, value: Any, source: str) -> None:
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        raise SettingsError(f"{f.name} (from {source}) is {value!r}; allowed: {', '.join(map(str, meta['choices']))}")
    lo, hi = meta.get("lo"), meta.get("hi")
    out_of_range = (lo is not None and not value >= lo) or (hi is not None and not value <= hi)  # NaN is neither
    if out_of_range:
        raise SettingsError(f"{f.name} (from {source}) is {value!r}; allowed range is {lo} to {hi}")
    why = meta["check"](value) if "check" in meta else None
    if why:
        raise SettingsError(f"{f.name} (from {source}): {why}")
