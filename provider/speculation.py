"""Speculation decisions, pure: whether a target gets a drafter, and whether each job speculates.

Plain data in, a decision out; no MLX, no I/O. The model residency asks `plan_drafter` when it loads a
target; the engine asks `plan` for every job. `SpeculationConfig` is the one owner of the node's policy
and k, built once from the settings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .jobs import SamplingParams
    from .models.capability import Capabilities


class Policy(str, enum.Enum):
    AUTO = "auto"  # speculate when eligible and memory allows
    ON = "on"  # fail loudly, with the reason, when a job cannot speculate
    OFF = "off"


class SpecMode(str, enum.Enum):
    OFF = "off"
    DRAFT = "draft"  # a smaller model with the same vocabulary proposes k tokens
    MTP = "mtp"  # a Gemma 4 assistant reads the target's K/V and hidden state and proposes k tokens


# Why a target has no drafter; the stable reasons telemetry carries.
NOT_MTP_CAPABLE, NO_DRAFTER, INSUFFICIENT_HEADROOM, POLICY_OFF = (
    "not_mtp_capable", "no_drafter", "insufficient_headroom", "policy_off")
BATCH_TOO_LARGE = "batch_too_large"  # other jobs share the model: the job decodes in their batch instead


@dataclass(frozen=True)
class SpeculationConfig:
    policy: Policy = Policy.AUTO
    k: int = 3  # draft tokens per round

    @classmethod
    def of(cls, settings) -> "SpeculationConfig":
        return cls(Policy(settings.speculation), settings.speculation_k)


@dataclass(frozen=True)
class DrafterPlan:
    mode: SpecMode | None  # None: the target serves alone
    reason: str  # "ok", or one of the stable reasons above


def plan_drafter(caps: "Capabilities", policy: Policy, need_bytes: int, free_bytes: int) -> DrafterPlan:
    """In the design's order: the target can use a drafter (decided from config files), the drafter fits
    the headroom left after the target, and the policy is not off."""
    mode = SpecMode.MTP if caps.mtp_capable else SpecMode.DRAFT if caps.draft_compatible else None
    if mode is None:
        # A drafter that was named but does not pair is `no_drafter` (the pairing problem is logged).
        return DrafterPlan(None, caps.drafter_reason if caps.drafter_reason == NOT_MTP_CAPABLE else NO_DRAFTER)
    if need_bytes > free_bytes:
        return DrafterPlan(None, INSUFFICIENT_HEADROOM)
    if policy is Policy.OFF:
        return DrafterPlan(None, POLICY_OFF)
    return DrafterPlan(mode, "ok")


@dataclass(frozen=True)
class SpecPlan:
    mode: SpecMode
    reason: str  # "ok" when speculating, else a stable reason (ineligible_request:<why>)
    k: int = 0

    @property
    def on(self) -> bool:
        return self.mode != SpecMode.OFF


def effective_policy(node_policy: Policy | str, job_policy: Policy | str) -> Policy:
    """A job's `on`/`off` overrides the node; `auto` defers to it."""
    return Policy(node_policy if job_policy == Policy.AUTO else job_policy)


def ineligibility(sampling: "SamplingParams") -> str | None:
    """What in a request the lossless greedy speculative path cannot honour."""
    if not sampling.greedy:
        return "sampling"
    if sampling.has_logits_processors:
        return "logits_processors"
    return None


def plan(*, policy: Policy | str, drafter_mode: SpecMode | str | None, drafter_reason: str,
         sampling: "SamplingParams", k: int, sharing: int = 0, max_batch: int = 1) -> SpecPlan:
    """One job's plan. `drafter_mode` is the loaded drafter's, or None with `drafter_reason` saying why.
    `sharing` jobs already run on the model; under `auto`, a job speculates only while the model's jobs
    number at most `max_batch` (speculating rows run alone, so past that the batch's throughput wins)."""
    if policy == Policy.OFF:
        return SpecPlan(SpecMode.OFF, POLICY_OFF)
    if drafter_mode is None:
        return SpecPlan(SpecMode.OFF, drafter_reason)
    why = ineligibility(sampling)
    if why is not None:
        return SpecPlan(SpecMode.OFF, f"ineligible_request:{why}")
    if policy == Policy.AUTO and sharing + 1 > max_batch:
        return SpecPlan(SpecMode.OFF, BATCH_TOO_LARGE)
    return SpecPlan(SpecMode(drafter_mode), "ok", k)
