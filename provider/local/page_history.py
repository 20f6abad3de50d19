"""The last hour of the node, for the page's charts: one sample every `SAMPLE_EVERY_S` in a ring of `SAMPLES`,
each made from two readings of the counters `NodeStatus` already carries and of the time-to-first-token histogram
/metrics exposes (its quantiles computed as Prometheus' `histogram_quantile` computes them, so the page and a
Grafana board over /metrics tell the same story). Pure: the server's sampler task feeds it."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from ..status import NodeStatus

SAMPLE_EVERY_S = 5.0
SAMPLES = 720  # an hour


@dataclass(frozen=True)
class Reading:
    """The cumulative figures at one moment."""

    t: float  # unix time
    tokens: int
    prompt_tokens: int
    prefix_hit_tokens: int
    jobs_ended: int
    drafted: int
    accepted: int
    forwards: int
    ttft: tuple[tuple[float, float], ...]  # (upper bound s, cumulative count), +Inf last

    @classmethod
    def of(cls, st: NodeStatus, ttft: list[tuple[float, float]], t: float) -> "Reading":
        c = st.counters
        return cls(t, c.tokens_generated, c.prompt_tokens, st.queue.prefix_hit_tokens,
                   c.jobs_completed + c.jobs_failed + c.jobs_cancelled, c.spec_drafted, c.spec_accepted,
                   c.spec_target_forwards, tuple(ttft))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate of the q-quantile from cumulative buckets (sorted by bound, +Inf last): linear within
    the bucket the rank falls in; the last finite bound if it falls in +Inf; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _ratio(num: float, den: float, cap: float | None = None) -> float | None:
    if den <= 0:
        return None
    r = num / den
    return round(min(r, cap) if cap is not None else r, 4)


def sample(a: Reading, b: Reading, running: int, queued: int) -> dict:
    """What happened between two readings: the charts' one point."""
    dt = max(b.t - a.t, 1e-9)
    d = lambda x, y: max(0, y - x)  # noqa: E731 (a counter never goes back within one process)
    drafted, accepted, forwards = d(a.drafted, b.drafted), d(a.accepted, b.accepted), d(a.forwards, b.forwards)
    ttft = [(le, max(0.0, cb - ca)) for (le, cb), (_, ca) in zip(b.ttft, a.ttft)] if len(a.ttft) == len(b.ttft) \
        else list(b.ttft)
    p50, p95 = histogram_quantile(0.5, ttft), histogram_quantile(0.95, ttft)
    return {
        "t": round(b.t, 3),
        "tokens_per_s": round(d(a.tokens, b.tokens) / dt, 3),
        "running": running,
        "queued": queued,
        "jobs_ended": d(a.jobs_ended, b.jobs_ended),
        "ttft_p50_ms": round(p50 * 1000, 3) if p50 is not None else None,
        "ttft_p95_ms": round(p95 * 1000, 3) if p95 is not None else None,
        "acceptance": _ratio(accepted, drafted),
        "tokens_per_forward": _ratio(accepted + forwards, forwards),
        "prefix_hit_share": _ratio(d(a.prefix_hit_tokens, b.prefix_hit_tokens), d(a.prompt_tokens, b.prompt_tokens),
                                   cap=1.0),
    }


class History:
    """The ring of samples, each numbered, so a page asks only for those it has not seen."""

    def __init__(self, size: int = SAMPLES):
        self.samples: collections.deque[dict] = collections.deque(maxlen=size)
        self.seq = 0
        self._last: Reading | None = None

    def add(self, reading: Reading, running: int, queued: int) -> None:
        if self._last is not None:
            self.seq += 1
            self.samples.append({"seq": self.seq} | sample(self._last, reading, running, queued))
        self._last = reading

    def since(self, seq: int) -> list[dict]:
        """The samples after `seq` (all of them for a page that has none, or one from before a restart)."""
        if seq > self.seq or seq < 0:
            seq = 0
        return [s for s in self.samples if s["seq"] > seq]
