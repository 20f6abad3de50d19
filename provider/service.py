"""systemd integration without a dependency: READY/STOPPING/WATCHDOG over $NOTIFY_SOCKET.

The watchdog is fed only while the engine loop is ticking, so a wedged engine
gets the service restarted. Without $NOTIFY_SOCKET (launchd, a terminal) these are no-ops.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time


def notify(message: str) -> bool:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace socket
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(path)
        s.sendall(message.encode())
    return True


def watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    return int(usec) / 2e6 if usec and usec.isdigit() else None


async def notify_loop(node, stop: asyncio.Event) -> None:
    notify("READY=1")
    interval = watchdog_interval() or 5.0
    while not stop.is_set():
        # The engine ticks at least once a second even when idle; a stale tick means it is stuck.
        if time.monotonic() - node.status().last_tick < max(2 * interval, 5.0):
            notify("WATCHDOG=1")
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
