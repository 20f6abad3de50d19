"""The session's outbox: the frames waiting for the writer, counted in bytes.

A coordinator that sends but never reads stops the writer (HTTP/2 flow control blocks its writes) while the
node would go on queueing: heartbeats, pongs, a ProtocolError per garbage frame, every job's chunks. The
outbox says when it holds more than its limit; the session then stops reading new frames (backpressure),
stops queueing heartbeats, paces what it sends again, and if the writer does not bring it back under the
limit within `stall_s`, ends the session with `CoordinatorNotReading`.
"""

from __future__ import annotations

import asyncio
import time


class CoordinatorNotReading(Exception):
    """The coordinator left the node's frames unread past the outbox's byte limit for too long."""


class Outbox:
    def __init__(self, limit_bytes: int, stall_s: float):
        self.limit = limit_bytes
        self.stall_s = stall_s
        self.bytes = 0
        self._queue: asyncio.Queue = asyncio.Queue()
        self._below = asyncio.Event()  # set while under the limit's half: a paused reader goes on
        self._below.set()
        self._over_since: float | None = None

    def put_nowait(self, frame) -> None:
        size = frame.ByteSize() if hasattr(frame, "ByteSize") else 0  # the end-of-stream marker weighs nothing
        self.bytes += size
        self._queue.put_nowait((frame, size))
        if self.over:
            self._below.clear()
            self._over_since = self._over_since or time.monotonic()

    async def get(self):
        frame, size = await self._queue.get()
        self.bytes -= size
        if self.bytes <= self.limit // 2:
            self._below.set()
            self._over_since = None
        return frame

    def empty(self) -> bool:
        return self._queue.empty()

    def qsize(self) -> int:
        return self._queue.qsize()

    @property
    def over(self) -> bool:
        return self.bytes > self.limit

    async def room(self) -> None:
        """Return once the outbox is back under half its limit; CoordinatorNotReading if it stays over for
        `stall_s`."""
        if self._below.is_set():
            return
        try:
            await asyncio.wait_for(self._below.wait(), self.stall_s)
        except asyncio.TimeoutError:
            raise CoordinatorNotReading(self.why()) from None

    def check(self) -> None:
        """CoordinatorNotReading if the outbox has been over its limit for `stall_s`."""
        if self._over_since is not None and time.monotonic() - self._over_since > self.stall_s:
            raise CoordinatorNotReading(self.why())

    def why(self) -> str:
        return (f"the coordinator has not read the node's frames: {self.bytes} bytes in {self.qsize()} frames "
                f"waiting, over the {self.limit}-byte limit for more than {self.stall_s:g} s")
