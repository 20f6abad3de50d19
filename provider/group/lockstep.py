"""The engine in lockstep across a group's ranks.

Rank 0 runs the node's engine as on one machine: it admits, schedules, samples nothing differently. Its batches
(`LeaderRunning`) record what changes them between steps (a row started, a row cancelled) and, at the start of
each step, send that plan to every rank; each follower (`follow`) applies the same changes to batches of its
own and runs the same step, so every rank calls the model with the same shapes in the same order and the
model's collectives meet. Every decision that rests on time, memory, queues or text is made on rank 0 only:
a follower receives each job with its prompt ids, its token budget and its seed already fixed.

After each step every rank checks, in one collective, that it produced the same tokens as the others: ranks
that diverge (different hardware, a fault on one rank) end the group rather than serve two answers.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from typing import Callable

from .. import logs
from ..engine.running import Delivery, Running
from ..engine.sampling import job_seed
from ..jobs import Job, JobError
from ..outputs import Done, Error, Tokens
from ..models.loader import LoadedModel
from ..speculation import SpecPlan
from ..types import Cause
from ..engine.collective import GroupLost
from ..engine.proposers import drafter_for
from .drafts import FollowerDrafts, LeaderDrafts
from .link import Link
from .plan import CancelRow, StartRow, StepPlan
from .proofs import refuse_false_commitments

log = logs.get("group")


def step_digest(deliveries: list[Delivery]) -> list[int]:
    """What a step produced, comparable across ranks: every job's new token ids and which jobs ended."""
    crc, ended = 0, 0
    for events, _ in deliveries:
        for ev in events:
            if isinstance(ev, Tokens):
                crc = zlib.crc32(f"{ev.job_id}:{ev.seq}:{ev.token_ids}".encode(), crc)
            elif isinstance(ev, (Done, Error)):
                ended += 1
                crc = zlib.crc32(f"{ev.job_id}:end".encode(), crc)
    return [crc & 0x7FFFFFFF, ended]


def check_step(link: Link, deliveries: list[Delivery]) -> None:
    if not link.agree(step_digest(deliveries)):
        log.error("group_diverged", rank=link.rank, step=[(ev.job_id, getattr(ev, "token_ids", "end"))
                                                          for events, _ in deliveries for ev in events][:64])
        raise GroupLost("the group's ranks produced different tokens in one step (different hardware or MLX "
                        "versions, or a fault on one rank); the group stops rather than serve either")


class LeaderRunning(Running):
    """Rank 0's batches: each change recorded, the plan sent before each step, the step's tokens checked."""

    def __init__(self, link: Link, beat: Callable[[], None], ready: threading.Event, **kw):
        super().__init__(**kw)
        self.link = link
        self._beat = beat
        self._changes: list[StartRow | CancelRow] = []
        self.ready = ready  # set once every rank has the model: nothing is sent before
        self._checked: set[str] = set()  # models whose commitments were checked possible on this rank (proofs)

    def start(self, job: Job, sink, lm: LoadedModel, prompt: list[int], *, max_tokens: int, plan: SpecPlan,
              shared_prefix: int, vision=None, **kw) -> None:
        if vision is not None:
            raise JobError(Cause.INVALID_REQUEST, "a node group does not take images or video", "messages")
        if lm.id not in self._checked:  # before its first row: a commitment is made only where it can be true
            self._checked.add(lm.id)
            refuse_false_commitments(lm)
        if not job.sampling.greedy and job.sampling.seed is None:  # every rank draws from the same key
            job = dataclasses.replace(job, sampling=dataclasses.replace(job.sampling, seed=job_seed(job.sampling)))
        self._changes.append(StartRow(job, tuple(prompt), max_tokens, plan, shared_prefix))
        super().start(job, sink, lm, prompt, max_tokens=max_tokens, plan=plan, shared_prefix=shared_prefix, **kw)

    def cancel(self, job_id: str):
        self._changes.append(CancelRow(job_id))
        return super().cancel(job_id)

    def drafter(self, lm: LoadedModel) -> LeaderDrafts:
        drafter = drafter_for(lm)
        if lm.drafter_lm_head is not None:  # the target's LM head is split across the ranks: the drafter's is whole
            drafter.lm_head = lm.drafter_lm_head
        return LeaderDrafts(drafter, self.link, lm.hidden_tap)

    def step(self) -> list[Delivery]:
        if not self.ready.is_set():
            return super().step()  # nothing runs before the model is loaded everywhere
        plan, self._changes = StepPlan(tuple(self._changes)), []
        self.link.send_plan(plan)
        deliveries = super().step()
        check_step(self.link, deliveries)
        self._beat()
        return deliveries

    def close(self) -> None:
        if self.ready.is_set():
            self.link.send_plan(StepPlan(tuple(self._changes), stop=True))
            self._changes = []


class FollowerRunning(Running):
    """Another rank's batches: its speculating rows verify rank 0's drafts (provider.group.drafts)."""

    def __init__(self, link: Link, **kw):
        super().__init__(**kw)
        self.link = link

    def drafter(self, lm: LoadedModel) -> FollowerDrafts:
        return FollowerDrafts(self.link, lm.logits_width, lm.hidden_tap)


def follow(link: Link, running: Running, lm: LoadedModel, grammar_for: Callable[[Job], object],
           tool_format, beat: Callable[[], None]) -> None:
    """A follower's loop: rank 0's plan, applied to this rank's batches, then the same step; until rank 0
    stops. Raises GroupLost (or MLX's error for a lost peer) when the group cannot go on."""

    def discard(_event) -> None:  # rank 0 answers the clients
        pass

    while True:
        plan = link.next_plan(lm.logits_width)
        beat()
        for change in plan.changes:
            if isinstance(change, CancelRow):
                running.cancel(change.job_id)
                continue
            try:
                running.start(change.job, discard, lm, list(change.prompt), max_tokens=change.max_tokens,
                              arrived=0.0, plan=change.plan, shared_prefix=change.shared_prefix,
                              grammar=grammar_for(change.job), tool_format=tool_format)
            except Exception as e:  # as on rank 0, whose engine then cancels the row (a change that follows)
                log.info("group_row_refused", job_id=change.job.id, error=f"{type(e).__name__}: {e}")
        if plan.stop:
            return
        check_step(link, running.step())
