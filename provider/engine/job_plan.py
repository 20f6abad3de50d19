"""How one job will decode: `job_plan` decides (pure over the job, the loaded pair and the node's policy)
to speculate, in the model's speculative batch (provider.engine.spec_batch), or to join the model's plain
batch (provider.engine.plain_batch) with the reason speculation is off.
"""

from __future__ import annotations

from ..jobs import Job, JobError
from ..types import Cause, Policy, SpecMode, SpecReason
from ..models.loader import LoadedModel
from .. import speculation
from .acceptance import GREEDY, SPECULATIVE_SAMPLING


def job_plan(job: Job, lm: LoadedModel, config: speculation.SpeculationConfig, sharing: int) -> speculation.SpecPlan:
    if job.verify is not None:  # it reads a claim and makes no tokens: what the request asked of decoding is moot
        return speculation.SpecPlan(SpecMode.OFF, SpecReason.POLICY_OFF)
    policy = speculation.effective_policy(config.policy, job.speculation)
    profile = lm.spec_profile
    scheme = GREEDY if job.sampling.greedy else SPECULATIVE_SAMPLING
    plan = speculation.plan(policy=policy, drafter_mode=lm.drafter_mode, drafter_reason=lm.drafter_reason,
                            sampling=job.sampling, k=config.k, sharing=sharing, max_batch=config.max_batch,
                            decide=(lambda rows: profile.decide(scheme, rows)) if profile is not None else None)
    if policy == Policy.AUTO and plan.on and lm.profile_pending:  # never a measurement in front of a job
        plan = speculation.SpecPlan(SpecMode.OFF, SpecReason.PROFILE_PENDING)
    if policy == Policy.ON and not plan.on:
        raise JobError(Cause.SPECULATION_UNAVAILABLE,
                       f"speculation was required (speculation=on) but is off for this job: {plan.reason}")
    return plan
