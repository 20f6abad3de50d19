"""A verify job's answer as it travels (provider.verification.verifier.Verdict, summed up): the verdict, and
the numbers of each chunk of the output it judged, so a coordinator sees where and by how much a claim failed,
not only that it did. And what it is judged by: how far an honest node's numbers may fall from a verifier's, per
backend (measured: docs/verification.md, "Tolerances"). The registration advertises its backend's, a
coordinator picks the looser of the producer's and the verifier's for a verify job, and a verifier clamps what it
is asked to apply to the loosest profile it knows, so no request loosens a check past what an honest backend
needs."""

from __future__ import annotations

import dataclasses
import math
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


@dataclass(frozen=True)
class Tolerance:
    """rel_tol: a committed value within this relative error of the verifier's counts as matched; min_overlap: a
    chunk fails below this share of matched points; max_mean_err: or when its matched points are off by more
    than this on average (weights 1% off move most values by less than rel_tol, but all of them); tie: a token
    this many nats short of the expected one is a near-tie the two forwards broke apart, not a failure, at most
    max_tie_share of the output's tokens (rounded down); floor: an unseeded speculative token less likely than
    this (nats) under the request's distribution fails."""

    rel_tol: float = 0.02
    min_overlap: float = 0.9
    max_mean_err: float = 0.003
    tie: float = 0.02
    max_tie_share: float = 0.05
    floor: float = 18.0
    profile: str = "cpu"
    min_ties: int = 0  # near-ties allowed whatever the length: none where honest work shows none (this CPU)


# A producer and a verifier on MLX's CPU backend with a float32 or float16 checkpoint: decode and prefill agree to
# float16 rounding.
CPU = Tolerance()
# Kernels that differ between producer and verifier (another accumulation order, a node group's all_sum) and any
# bfloat16 checkpoint (its decode and prefill differ even on this CPU): the cover of what
# tools/bench/verify_divergence.py measured, emulated on this CPU until a Mac and a GPU measure their own. It lets
# 8-bit weights through on llama-tiny (docs/verification.md, "Kernels that differ").
DIVERGENT_KERNELS = Tolerance(rel_tol=0.15, min_overlap=0.8, max_mean_err=0.024, tie=0.15, max_tie_share=0.22,
                              floor=18.0, profile="divergent_kernels", min_ties=1)  # bf16 argmaxes flip at ~3%
PROFILES = {t.profile: t for t in (CPU, DIVERGENT_KERNELS)}
BACKEND_PROFILE = {"cpu": CPU, "metal": DIVERGENT_KERNELS, "cuda": DIVERGENT_KERNELS}

# Per field, which way is looser.
_LOOSER = {"rel_tol": max, "min_overlap": min, "max_mean_err": max, "tie": max, "max_tie_share": max, "floor": max,
           "min_ties": max}


def for_backend(backend: str, bfloat16: bool = False) -> Tolerance:
    """The profile honest work of this backend needs; a bfloat16 checkpoint needs the divergent one everywhere."""
    return DIVERGENT_KERNELS if bfloat16 else BACKEND_PROFILE.get(backend, DIVERGENT_KERNELS)


def looser(a: Tolerance, b: Tolerance) -> Tolerance:
    """Field by field the looser of two (a producer's and its verifier's backends)."""
    return Tolerance(**{f: pick(getattr(a, f), getattr(b, f)) for f, pick in _LOOSER.items()},
                     profile=a.profile if a.profile == b.profile else f"{a.profile}+{b.profile}")


def clamped(t: Tolerance) -> Tolerance:
    """`t` held to the loosest profile known (and to finite values): a verify job may tighten, never loosen past it."""
    loosest = PROFILES.values()
    out = {}
    for f, pick in _LOOSER.items():
        tighter = min if pick is max else max
        limit = pick(getattr(p, f) for p in loosest)
        value = getattr(t, f)
        out[f] = limit if not math.isfinite(value) else max(0.0, tighter(value, limit))
    out["min_overlap"] = min(1.0, out["min_overlap"])
    out["min_ties"] = int(out["min_ties"])
    return dataclasses.replace(t, **out)
