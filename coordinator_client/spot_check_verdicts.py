"""The spot-check verdicts a coordinator tells this node about its own jobs (SpotCheckResult, docs/verification.md).

Informational: the coordinator's tally is what counts, and a coordinator can send any number of these, so the node
only counts them, keeps the last few failures with their text cut short, and logs a failed one (throttled). The
node's page and `provider status --json` show them (the session's detail).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from .convert import MAX_JOB_ID
from .pb import provider_pb2 as pb

KEPT_FAILURES = 10  # the latest failed verdicts the page lists
MAX_REASON = 300  # characters of a verdict's reason kept (the verifier's reasons are one line)


@dataclass
class SpotCheckVerdicts:
    passed: int = 0
    failed: int = 0
    last_at: float | None = None  # unix time of the latest verdict
    recent_failures: collections.deque = field(default_factory=lambda: collections.deque(maxlen=KEPT_FAILURES))

    def record(self, result: pb.SpotCheckResult) -> dict | None:
        """Count one verdict; a failed one's entry (as kept) is returned for the log."""
        self.last_at = time.time()
        if result.passed:
            self.passed += 1
            return None
        self.failed += 1
        entry = {"job_id": result.job_id[:MAX_JOB_ID], "reason": result.reason[:MAX_REASON],
                 "first_failure": result.first_failure if result.HasField("first_failure") else None,
                 "at": self.last_at}
        self.recent_failures.append(entry)
        return entry

    def as_dict(self) -> dict:
        return {"passed": self.passed, "failed": self.failed, "last_at": self.last_at,
                "recent_failures": list(self.recent_failures)}
