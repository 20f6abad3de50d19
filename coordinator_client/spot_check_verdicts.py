"""The spot-check verdicts a coordinator tells this node about its own jobs (SpotCheckResult, docs/verification.md).

Informational: the coordinator's tally is what counts, and a coordinator can send any number of these, so the node
only counts them, keeps the last few failures with their text cut short and made printable, and logs a failed one
(throttled). A verdict on a job id this node has no outcome of (another process's, or one it never ran) is counted
apart, never as its own. The node's page and `provider status` show them (the session's detail).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from provider.logs import CLIP_CHARS

from .pb import provider_pb2 as pb

KEPT_FAILURES = 10  # the latest failed verdicts `provider status --json` lists


def printable(text: str, limit: int = CLIP_CHARS) -> str:
    """A peer's text as a terminal, a log line or the page may show it: cut short, and control characters (an
    escape sequence, a forged new line) replaced."""
    return "".join(c if c.isprintable() else "\ufffd" for c in text[:limit])


@dataclass
class SpotCheckVerdicts:
    passed: int = 0
    failed: int = 0
    unknown_jobs: int = 0  # verdicts on job ids this node has no outcome of: not counted as its own
    last_at: float | None = None  # unix time of the latest verdict on one of its jobs
    recent_failures: collections.deque = field(default_factory=lambda: collections.deque(maxlen=KEPT_FAILURES))

    def record(self, result: pb.SpotCheckResult, ran: bool) -> dict | None:
        """Count one verdict (`ran`: this node has the job's outcome); a failed one's entry, as kept, is returned
        for the log."""
        if not ran:
            self.unknown_jobs += 1
            return None
        self.last_at = time.time()
        if result.passed:
            self.passed += 1
            return None
        self.failed += 1
        entry = {"job_id": printable(result.job_id), "reason": printable(result.reason),
                 "first_failure": result.first_failure if result.HasField("first_failure") else None,
                 "at": self.last_at}
        self.recent_failures.append(entry)
        return entry

    def as_dict(self) -> dict:
        return {"passed": self.passed, "failed": self.failed, "unknown_jobs": self.unknown_jobs,
                "last_at": self.last_at, "recent_failures": list(self.recent_failures)}
