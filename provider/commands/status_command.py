"""`provider status`: the running daemon's state, asked live over its control socket; the snapshot it writes
every 2 s (status_file) when the socket does not answer, with the snapshot's age said."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from .. import paths, status_file
from ..startup import holder_pid

EXIT_NOT_RUNNING = 3  # no daemon runs on this state directory
LIVE_TIMEOUT_S = 3.0


def run(args: argparse.Namespace) -> int:
    state = paths.state_dir()
    pid = holder_pid(state)
    if pid is None:
        print(f"provider: no provider daemon is running (state directory {state})", file=sys.stderr)
        return EXIT_NOT_RUNNING
    body, source = _live(), "live"
    if body is None or body.get("pid") != pid:
        body = status_file.read(state)
        if body is None or body.get("pid") != pid:
            print(f"provider: provider pid {pid} is starting (no status yet; state directory {state})",
                  file=sys.stderr)
            return EXIT_NOT_RUNNING
        source = f"snapshot written {max(0.0, time.time() - body['written_at']):.1f} s ago (the daemon did not answer)"
    if args.json:
        print(json.dumps(body | {"source": source}, indent=2))
    else:
        print(status_file.summary(body) + f"\n  status: {source}")
    return 0


def _live() -> dict | None:
    """The daemon's status over its control socket now, or None (no socket, no answer in LIVE_TIMEOUT_S)."""
    from . import daemon_client

    try:
        code, body = asyncio.run(daemon_client.call("GET", "/provider/v1/status", timeout=LIVE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 (no socket, a timeout, a daemon stopping: the snapshot then)
        return None
    return body if code == 200 and isinstance(body, dict) else None
