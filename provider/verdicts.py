"""A verify job's answer as it travels (provider.verification.verifier.Verdict, summed up): the verdict, and
the numbers of each chunk of the output it judged, so a coordinator sees where and by how much a claim failed,
not only that it did."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkVerdict:
    """One chunk of the judged output (commitment.CHUNK tokens, the last one shorter)."""

    start: int  # its first output position
    overlap: float  # the share of its committed entries the verifier found again
    max_rel_err: float  # among those, the largest relative error
    mean_rel_err: float  # and their mean (a chunk fails above verifier.Tolerance.max_mean_err too)
    max_gap: float | None  # the largest shortfall of one of its tokens from the one expected (nats); None: none
    ties: int  # its tokens within the tie tolerance of the expected one


@dataclass(frozen=True)
class VerdictSummary:
    passed: bool
    reason: str
    first_failure: int | None
    tokens: int
    chunks: int
    min_overlap: float | None = None  # the lowest share of a chunk's committed entries the verifier found again
    max_rel_err: float | None = None  # among those, the largest relative error
    max_gap: float | None = None  # the largest shortfall of a token from the one expected (nats)
    ties: int = 0  # tokens within the tie tolerance of the expected one
    per_chunk: tuple[ChunkVerdict, ...] = ()
