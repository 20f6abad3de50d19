"""One job's decode, advanced one token per `step()` by the engine thread.

The prompt arrives as token ids, tokenized off this thread (provider.prompts).
Tokens come from mlx-lm's `generate_step` (prefill leaves the last prompt token
for a width-1 step, as mlx-lm does); text from mlx-lm's streaming detokenizer,
so multi-byte characters are never split across chunks.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..jobs import Cause, Done, Event, Job, JobError, Tokens, Usage
from ..telemetry import FinishReason, SpecTelemetry, Telemetry
from ..models.loader import LoadedModel
from .. import speculation
from .sampling import logits_processors_for, sampler_for
from .speculative import DraftModelDrafter, MTPDrafter, SpecStats, Target, speculative_tokens
from .stops import StopMatcher

class Generation:
    def __init__(self, job: Job, lm: LoadedModel, prompt: list[int], *, prefill_step_size: int, arrived: float,
                 config: speculation.SpeculationConfig):
        self.job = job
        self.model_id = lm.id
        self.prompt_tokens = len(prompt)
        # provider.prompts refused prompts that leave no room; generate only up to the context.
        self.max_tokens = min(job.sampling.max_tokens, lm.context_length - len(prompt))
        self.completion_tokens = 0
        self._seq = 0
        policy = speculation.effective_policy(config.policy, job.speculation)
        self.plan = speculation.plan(policy=policy, drafter_mode=lm.drafter_mode, drafter_reason=lm.drafter_reason,
                                     sampling=job.sampling, k=config.k)
        if policy == speculation.Policy.ON and not self.plan.on:
            raise JobError(Cause.SPECULATION_UNAVAILABLE,
                           f"speculation was required (speculation=on) but is off for this job: {self.plan.reason}")
        self.spec_stats: SpecStats | None = None
        if self.plan.on:
            self.spec_stats = SpecStats(self.plan.mode, self.plan.k)
            drafter = (MTPDrafter(lm.drafter, Target(lm.model)) if self.plan.mode == speculation.SpecMode.MTP
                       else DraftModelDrafter(lm.drafter))
            self._tokens = ((t, None) for t in speculative_tokens(
                lm.model, prompt, drafter, k=self.plan.k, stats=self.spec_stats, prefill_step=prefill_step_size))
        else:
            self._tokens = generate_step(
                mx.array(prompt),
                lm.model,
                max_tokens=self.max_tokens,
                sampler=sampler_for(job.sampling),
                logits_processors=logits_processors_for(job.sampling),
                prefill_step_size=prefill_step_size,
            )
        self._detok = lm.tokenizer.detokenizer
        self._stops = StopMatcher(job.sampling.stop)
        self._eos = set(lm.tokenizer.eos_token_ids) | set(job.sampling.stop_token_ids)
        # The engine loop owns the timestamps (monotonic seconds).
        self.t_arrived = arrived
        self.t_started = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None

    def step(self) -> list[Event]:
        """Generate one token; return its events (a final `Done` when the job ends)."""
        try:
            token, _ = next(self._tokens)
        except StopIteration:
            return self.finish(FinishReason.LENGTH)
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        if token in self._eos:
            return self.finish(FinishReason.STOP)
        self.completion_tokens += 1
        self._detok.add_token(token)
        text, hit_stop = self._stops.feed(self._detok.last_segment)
        events: list[Event] = [self._chunk(text, (token,))]
        if hit_stop:
            return events + self.finish(FinishReason.STOP, flush=False)
        if self.completion_tokens >= self.max_tokens:
            return events + self.finish(FinishReason.LENGTH)
        return events

    def close(self) -> None:
        """Stop generating (the generator's caches are freed with it)."""
        self._tokens.close()

    def finish(self, reason: FinishReason, *, flush: bool = True) -> list[Event]:
        self.close()
        events: list[Event] = []
        if flush and reason != FinishReason.CANCELLED:
            self._detok.finalize()
            tail, hit_stop = self._stops.feed(self._detok.last_segment)
            tail += "" if hit_stop else self._stops.flush()
            if tail:
                events.append(self._chunk(tail, ()))
        usage = Usage(self.prompt_tokens, self.completion_tokens)
        events.append(Done(self.job.id, reason, usage, self.telemetry(reason)))
        return events

    def _chunk(self, text: str, ids: tuple[int, ...]) -> Tokens:
        ev = Tokens(self.job.id, self._seq, text, ids)
        self._seq += 1
        return ev

    def telemetry(self, finish_reason: FinishReason) -> Telemetry:
        end = time.perf_counter()
        first = self.t_first
        decode_s = (self.t_last - first) if first is not None and self.t_last is not None else 0.0
        spec = (self.spec_stats.telemetry() if self.spec_stats
                else SpecTelemetry(speculation.SpecMode.OFF, self.plan.reason))
        return Telemetry(
            finish_reason=finish_reason,
            speculation=spec,
            ttft_ms=round((first - self.t_arrived) * 1000, 3) if first is not None else None,
            queue_ms=round((self.t_started - self.t_arrived) * 1000, 3),
            total_ms=round((end - self.t_arrived) * 1000, 3),
            prefill_tokens_per_s=round(self.prompt_tokens / (first - self.t_started), 3) if first else None,
            # Tokens after the first, over the time since the first: the steady decode rate.
            decode_tokens_per_s=round((self.completion_tokens - 1) / decode_s, 3) if decode_s > 0 else None,
            peak_memory_bytes=mx.get_peak_memory(),
        )
