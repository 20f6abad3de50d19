"""systemd integration without a dependency: READY, STATUS, EXTEND_TIMEOUT_USEC, WATCHDOG and STOPPING over
$NOTIFY_SOCKET.

While a model downloads or loads, the start timeout is extended in steps, so a first start that fetches
weights does not hit the start limit; READY comes once the node can serve. The watchdog is fed only while
the engine loop ticks (it does at least once a second when idle, and between prefill chunks when busy), so
a wedged engine stops the pings and systemd restarts the node. Without $NOTIFY_SOCKET (launchd, a
terminal) all of this is a no-op.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Callable

EXTEND_S = 30.0  # each EXTEND_TIMEOUT_USEC buys this long; re-sent every third of it while loading


def notify(message: str) -> bool:
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            # Never wait on the manager: a full queue (a manager not reading) would otherwise block the caller,
            # the event loop or a group rank's step loop, while its peers wait inside a collective.
            s.setblocking(False)
            s.connect(path)
            s.sendall(message.encode())
    except OSError:  # the manager went away or is not reading: nothing to tell
        return False
    return True


def watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    return int(usec) / 2e6 if usec and usec.isdigit() else None


async def while_loading(what: str) -> None:
    """Run beside a load; cancel it when the load ends."""
    while True:
        notify(f"EXTEND_TIMEOUT_USEC={int(EXTEND_S * 1e6)}\nSTATUS=loading {what}")
        await asyncio.sleep(EXTEND_S / 3)


async def notify_loop(node, stop: asyncio.Event, describe: Callable[[], str]) -> None:
    """READY, then STATUS and WATCHDOG until `stop`; the pings stop when the engine stops ticking."""
    notify(f"READY=1\nSTATUS={describe()}")
    interval = watchdog_interval() or 5.0
    while not stop.is_set():
        message = f"STATUS={describe()}"
        if time.monotonic() - node.status().last_tick < max(2 * interval, 5.0):
            message += "\nWATCHDOG=1"
        notify(message)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
