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


# A Reject's retry_after_s is the coordinator's word, a uint32: unbounded it parks the node for up to 136 years.
# Fifteen minutes covers a coordinator's restart or maintenance; a refusal for good is what `permanent` says.
MAX_RETRY_AFTER_S = 900.0


def reconnect_delay(backoff_s: float, retry_after_s: float) -> float:
    """The wait before the next dial: the backoff's, or longer when a Reject asked for it (capped)."""
    return max(backoff_s, min(retry_after_s, MAX_RETRY_AFTER_S))
