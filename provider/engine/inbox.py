"""What goes into the engine's inbox from other threads, besides a submitted job (waiting.Pending)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Cancel:
    job_id: str


@dataclass(frozen=True)
class Stop:
    grace_s: float  # in-flight jobs get this long to finish


@dataclass(frozen=True)
class Call:
    fn: Callable[[], object]  # runs between steps, on the engine thread (the residency's one caller)
    result: concurrent.futures.Future


WAKE = object()  # a prompt or a model became ready: look at the queue again

# The inbox carries Pending (a submitted job), Cancel, Stop, Call and WAKE.
