"""The stored responses behind `previous_response_id` and GET/DELETE /v1/responses/{id}: bounded by count, by
bytes and by age, oldest dropped first. Each entry keeps the conversation as items (the input that led to the
response, then its output) and the response object as returned. In memory only: a restart forgets them."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 256
MAX_BYTES = 64 << 20  # their items and bodies, serialized
MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class Stored:
    items: tuple[dict[str, Any], ...]  # the whole conversation up to and including this response's output
    body: dict[str, Any]  # the response object
    size: int
    at: float


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES, max_age_s: float = MAX_AGE_S,
                 clock=time.monotonic):
        self.max_responses, self.max_bytes, self.max_age_s = max_responses, max_bytes, max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, items: list[dict[str, Any]], body: dict[str, Any]) -> bool:
        """Keep a response; False when it alone is larger than the store (it is then not kept)."""
        size = len(json.dumps(items, separators=(",", ":"))) + len(json.dumps(body, separators=(",", ":")))
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response_id)
            self._entries[response_id] = Stored(tuple(items), body, size, self._clock())
            self._bytes += size
            self._expire()
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

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
