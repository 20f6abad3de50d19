"""Reconnect delays: capped exponential backoff with full jitter (pure; the caller supplies randomness)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Backoff:
    base: float
    cap: float
    rand: Callable[[], float] = field(default=random.random)
    attempt: int = 0

    def next_delay(self) -> float:
        """Uniform in [0, min(cap, base * 2**attempt)], then the exponent grows."""
        ceiling = min(self.cap, self.base * (2 ** min(self.attempt, 62)))
        self.attempt += 1
        return self.rand() * ceiling

    def reset(self) -> None:
        """Call only after a healthy session, so a flapping coordinator keeps the delays long."""
        self.attempt = 0
