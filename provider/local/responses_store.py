"""The stored responses behind `previous_response_id` and GET/DELETE /v1/responses/{id}: bounded by count, by
bytes and by age, oldest dropped first. Each entry keeps the conversation as items (the input that led to the
response, then its output) and the response object as returned, both as compact JSON bytes: what the store
counts is what it holds (Python objects of the same items took ~20x their JSON, unknown keys and all: a 9 MB
request held 203 MiB). Its bytes are booked in the node's memory ledger (`on_change`) and shown in /health and
`provider status`. In memory only: a restart forgets them."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from .json_bounds import scan

MAX_RESPONSES = 256
MAX_BYTES = 64 << 20  # their items and bodies as held, with ENTRY_BYTES each
MAX_AGE_S = 3600.0
ENTRY_BYTES = 512  # what an entry holds beside its two byte strings: its id, the entry, the map's slot


@dataclass(frozen=True, slots=True)
class Stored:
    items: bytes  # the whole conversation up to and including this response's output, a JSON array
    values: int  # JSON values and keys in `items` (json_bounds.scan): a chain is bounded as one body is
    body: bytes  # the response object, as returned
    at: float

    @property
    def size(self) -> int:
        return len(self.items) + len(self.body) + ENTRY_BYTES


def compact(value: Any) -> bytes:
    """JSON with no spaces; ASCII, so a lone surrogate a left-out item carried is kept as its escape."""
    return json.dumps(value, separators=(",", ":")).encode()


def joined(first: bytes, then: bytes) -> bytes:
    """Two JSON arrays (compact) as one, without parsing either."""
    if first == b"[]":
        return then
    return first if then == b"[]" else first[:-1] + b"," + then[1:]


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES, max_age_s: float = MAX_AGE_S,
                 clock=time.monotonic, on_change: Callable[[int], None] | None = None):
        self.max_responses, self.max_bytes, self.max_age_s = max_responses, max_bytes, max_age_s
        self._clock = clock
        self._on_change = on_change  # told the bytes held after every change (the memory ledger's booking)
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, items: list[dict[str, Any]] | bytes, body: dict[str, Any]) -> bool:
        """Keep a response (its conversation as items, or as a compact JSON array); False when it alone is larger
        than the store (it is then not kept). Serializes and counts: call it off the event loop."""
        blob = items if isinstance(items, bytes) else compact(items)
        entry = Stored(blob, scan(blob).values, compact(body), self._clock())
        if entry.size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response_id)
            self._entries[response_id] = entry
            self._bytes += entry.size
            self._expire()
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._changed()
        return True

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            self._changed()
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            dropped = self._drop(response_id)
            self._changed()
            return dropped

    def stats(self) -> tuple[int, int]:
        with self._lock:
            return len(self._entries), self._bytes

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry is not None

    def _expire(self) -> None:
        oldest = self._clock() - self.max_age_s
        while self._entries and next(iter(self._entries.values())).at < oldest:
            self._drop(next(iter(self._entries)))

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self._bytes)
