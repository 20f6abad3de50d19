"""Whether a job speculates, and if not, the stable reason why. Pure: plain data in, a plan out."""

from __future__ import annotations

from dataclasses import dataclass

from ..jobs import SamplingParams

REASONS = ("not_mtp_capable", "no_drafter", "insufficient_headroom", "policy_off", "ineligible_request")


@dataclass(frozen=True)
class SpecPlan:
    mode: str  # off | draft | mtp
    reason: str  # "ok" when speculating, else one of REASONS (ineligible_request:<why>)
    k: int = 0

    @property
    def on(self) -> bool:
        return self.mode != "off"


def effective_policy(node_policy: str, job_policy: str) -> str:
    """A job's `on`/`off` overrides the node; `auto` defers to it."""
    return node_policy if job_policy == "auto" else job_policy


def ineligibility(sampling: SamplingParams) -> str | None:
    """What in a request the lossless greedy speculative path cannot honour."""
    if not sampling.greedy:
        return "sampling"
    if sampling.has_logits_processors:
        return "logits_processors"
    return None


def plan(*, policy: str, drafter_mode: str | None, drafter_reason: str, sampling: SamplingParams, k: int) -> SpecPlan:
    """`drafter_mode` is the loaded drafter's mode, or None with `drafter_reason` saying why none is loaded."""
    if policy == "off":
        return SpecPlan("off", "policy_off")
    if drafter_mode is None:
        return SpecPlan("off", drafter_reason)
    why = ineligibility(sampling)
    if why is not None:
        return SpecPlan("off", f"ineligible_request:{why}")
    return SpecPlan(drafter_mode, "ok", k)
