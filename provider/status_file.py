"""The live daemon's state for `provider status`: a 0600 JSON file in the state directory, rewritten every
couple of seconds from `NodeStatus`, so an operator reads it without the public port or its token.

Whether a daemon runs is told by the instance lock (provider.startup), not by the file: a file left by a
process that died is reported as stale, never as a running node.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .status import NodeStatus

FILE_NAME = "status.json"


def snapshot(st: NodeStatus, *, pid: int, started: float, mode: str, local_url: str | None,
             coordinator: str | None, session: str | None, session_detail: dict | None = None) -> dict[str, Any]:
    body = dataclasses.asdict(st)
    body.pop("last_tick", None)  # a monotonic time means nothing to another process
    return {
        "pid": pid, "version": __version__, "written_at": time.time(), "started_at": round(started, 3),
        "uptime_s": round(time.time() - started, 1), "mode": mode,
        "local_url": local_url, "coordinator": coordinator, "coordinator_session": session,
        "coordinator_session_detail": session_detail,
        "engine_tick_age_s": round(time.monotonic() - st.last_tick, 3),
        **body,
    }


@dataclass
class DaemonFacts:
    """What the daemon knows of itself beside `NodeStatus` (its process, mode and front ends): the status file and
    the node's page (provider/local/dashboard.py) are both made by `snapshot`, so they never disagree. The daemon
    sets `local_url` once it listens."""

    pid: int
    started: float
    mode: str = ""
    coordinator: str | None = None
    local_url: str | None = None
    # The coordinator session, or None without one: {"state": connecting | connected | rejected, "connected_since":
    # unix time or None, "sessions", "jobs_received", "outcomes_sent", "spot_checks": the verdicts the coordinator told
    # of this node's jobs (coordinator_client/spot_check_verdicts.py)}.
    session: Callable[[], dict | None] = lambda: None

    def snapshot(self, st: NodeStatus) -> dict[str, Any]:
        detail = self.session()
        return snapshot(st, pid=self.pid, started=self.started, mode=self.mode, local_url=self.local_url,
                        coordinator=self.coordinator, session=detail["state"] if detail else None,
                        session_detail=detail)


def write(state_dir: Path, body: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = state_dir / f".{FILE_NAME}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(body, default=str).encode())
    finally:
        os.close(fd)
    os.replace(tmp, state_dir / FILE_NAME)


def read(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir / FILE_NAME).read_text())
    except (OSError, ValueError):
        return None


def remove(state_dir: Path) -> None:
    try:
        (state_dir / FILE_NAME).unlink()
    except OSError:
        pass


def summary(body: dict[str, Any]) -> str:
    """What `provider status` prints: a few lines an operator reads at a glance."""
    mem = body["memory"]
    mib = 1 << 20
    resident = [m for m in body["models"] if m["state"] != "available"]
    models = ", ".join(f"{m['id']} ({m['state']}, {m['active_jobs']} jobs, {staying(m)})" for m in resident) \
        or "none resident"
    c = body["counters"]
    lines = [
        f"provider pid {body['pid']}: {body['health']}, up {body['uptime_s']:.0f} s, mode {body['mode'] or 'none'}",
        f"  local API: {body['local_url'] or 'off'}",
        f"  coordinator: {body['coordinator'] or 'off'}"
        + (f" ({body['coordinator_session']})" if body['coordinator'] else ""),
        f"  models: {models}",
        f"  jobs: {body['active_jobs']} active, {body['queued_jobs']} queued "
        f"({body['queue']['waiting_for_memory']} waiting for memory), {c['jobs_completed']} completed, "
        f"{c['jobs_failed']} failed, {c['jobs_cancelled']} cancelled, {c['tokens_generated']} tokens",
        f"  memory: {mem['reserved_bytes'] / mib:.0f} MiB used of {mem['usable_bytes'] / mib:.0f} MiB "
        f"(models {mem['models_bytes'] / mib:.0f}, jobs' KV {mem['jobs_kv_bytes'] / mib:.0f}, prefix cache "
        f"{mem['prefix_cache_bytes'] / mib:.0f}, stored responses {mem.get('responses_store_bytes', 0) / mib:.1f}; "
        f"MLX holds {mem['mlx_active_bytes'] / mib:.0f}, "
        f"{mem.get('unaccounted_bytes', 0) / mib:.0f} of it outside the ledger)",
        f"  speculation: {c['spec_drafted']} drafted, {c['spec_accepted']} accepted, "
        f"{c['spec_target_forwards']} target forwards",
    ]
    checks = (body.get("coordinator_session_detail") or {}).get("spot_checks")
    if checks:
        lines.insert(3, f"  spot checks of this node's jobs: {checks['passed']} passed, {checks['failed']} failed"
                        + "".join(f" (latest failure: {f['job_id']}, {f['reason']})"
                                  for f in checks["recent_failures"][-1:]))
    lines += [f"  {m['id']} speculation profile: {profile_line(m['speculation_profile'])}" for m in resident
              if m.get("speculation_profile")]
    return "\n".join(lines)


def staying(m: dict) -> str:
    """How long a loaded model stays, in a few words."""
    if m.get("pinned"):
        return "pinned"
    if m.get("keep_alive_s") is None:
        return "kept"
    if m.get("unload_at") is None:
        return f"unloads {m['keep_alive_s']:g} s after its jobs"
    return f"unloads in {max(0.0, m['unload_at'] - time.time()):.0f} s if idle"


def profile_line(origin: dict) -> str:
    """Where a pair's speculation costs came from, in a few words."""
    if origin["source"] == "measuring":
        return "measuring now (auto decodes plain until it is done)"
    where = f"read from {origin.get('file')}, measured" if origin["source"] == "file" else "measured at this load,"
    return (f"{where} {origin.get('measured_at')}" + (" (stale)" if origin.get("stale") else "")
            + ("; measuring again" if origin.get("measuring") else ""))
