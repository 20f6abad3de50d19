"""How one job will decode, and the decode of a job that speculates.

`job_plan` decides (pure over the job, the loaded pair and the node's policy): speculate, or join the
model's batch (provider.engine.batch) with the reason speculation is off. A speculating job runs its own
rounds (provider.engine.speculative), advanced one round per `step()` by the engine thread; its tokens go
through the same JobOutput as a batched row's.
"""

from __future__ import annotations

from ..jobs import Cause, Event, Job, JobError
from ..models.loader import LoadedModel
from .. import speculation
from ..telemetry import FinishReason
from .acceptance import GREEDY, SPECULATIVE_SAMPLING, choice_for
from .output import JobOutput
from .sampling import logits_processors_for, sampler_for
from .speculative import SpecStats, drafter_for, speculative_tokens

__all__ = ["SpeculativeGeneration", "job_plan", "logits_processors_for", "sampler_for"]


def job_plan(job: Job, lm: LoadedModel, config: speculation.SpeculationConfig, sharing: int) -> speculation.SpecPlan:
    policy = speculation.effective_policy(config.policy, job.speculation)
    profile = lm.spec_profile
    scheme = GREEDY if job.sampling.greedy else SPECULATIVE_SAMPLING
    plan = speculation.plan(policy=policy, drafter_mode=lm.drafter_mode, drafter_reason=lm.drafter_reason,
                            sampling=job.sampling, k=config.k, sharing=sharing,
                            decide=(lambda: profile.decide(scheme)) if profile is not None else None)
    if policy == speculation.Policy.ON and not plan.on:
        raise JobError(Cause.SPECULATION_UNAVAILABLE,
                       f"speculation was required (speculation=on) but is off for this job: {plan.reason}")
    return plan


class SpeculativeGeneration:
    def __init__(self, output: JobOutput, lm: LoadedModel, prompt: list[int], plan: speculation.SpecPlan, *,
                 prefill_step_size: int):
        self.output = output
        self.model_id = lm.id
        self._profile = lm.spec_profile
        output.spec_stats = SpecStats(plan.mode, plan.k, choice=plan.choice)
        self._tokens = speculative_tokens(lm.model, prompt, drafter_for(lm), k=plan.k, stats=output.spec_stats,
                                          prefill_step=prefill_step_size, choice=choice_for(output.job.sampling))

    def step(self) -> list[Event]:
        """One token (a round's tokens come out one per step); a final `Done` when the job ends."""
        try:
            token = next(self._tokens)
        except StopIteration:
            return self.finish(FinishReason.LENGTH)
        events = self.output.token(token)
        if self.output.finished:
            self.close()
        return events

    def close(self) -> None:
        self._tokens.close()
        stats, profile, self._profile = self.output.spec_stats, self._profile, None  # observed once
        if profile is not None:  # what this job saw keeps auto's estimate current
            profile.observe(stats.scheme, stats.accepted, stats.judged)

    def finish(self, reason: FinishReason) -> list[Event]:
        self.close()
        return self.output.finish(reason)
