"""Stop strings over a text stream: emit text as soon as it cannot be the start of a stop string."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.hit: str | None = None  # the stop string that ended the text, once one did

    def feed(self, text: str) -> tuple[str, bool]:
        """Add `text`; return (text safe to emit, whether a stop string was hit)."""
        if not self._stops:
            return text, False
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            at = min(hits)
            self.hit = next(s for s in self._stops if buf.find(s) == at)
            return buf[:at], True
        hold = max((self._held_suffix(buf, s) for s in self._stops), default=0)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    @staticmethod
    def _held_suffix(buf: str, stop: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of `stop`."""
        for k in range(min(len(stop) - 1, len(buf)), 0, -1):
            if buf.endswith(stop[:k]):
                return k
        return 0
