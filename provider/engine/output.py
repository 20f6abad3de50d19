"""One job's output: token ids in, events out (text chunks, a final Done), and the job's timestamps.

The same for a batched row and a speculating job: EOS and stop ids end the job without being emitted;
text comes from mlx-lm's streaming detokenizer, so a multi-byte character is never split across chunks;
stop strings are matched on the text. The engine loop owns the timestamps (perf_counter seconds).
"""

from __future__ import annotations

import dataclasses
import time

import mlx.core as mx

from ..jobs import Job
from ..outputs import (
    GREEDY_SAMPLER, REPLAYABLE_SAMPLER, SPECULATIVE_SAMPLER, Done, Event, Proof, TokenLogprob, Tokens, Usage,
)
from ..telemetry import SpecTelemetry, Telemetry
from ..types import FinishReason, SpecMode
from ..models.tool_format import ToolFormat
from .sampling import job_seed
from .stops import StopMatcher
from .tool_calls import ToolCallSplitter


def end_ids(tokenizer, sampling) -> set[int]:
    """The ids that end a job's output unemitted (its grammar's EOS too): the model's and the job's stop ids."""
    return set(tokenizer.eos_token_ids) | set(sampling.stop_token_ids)


class JobOutput:
    def __init__(self, job: Job, tokenizer, *, prompt_tokens: int, max_tokens: int, arrived: float,
                 cached_prompt_tokens: int = 0, cached_tier: str = "", spec_off_reason: str = "", spec_choice=None,
                 tool_format: ToolFormat | None = None):
        self.job = job
        # The seed its sampled tokens are drawn with: the job's, or one drawn now (reported, so they replay).
        self.seed = None if job.sampling.greedy else job_seed(job.sampling)
        self.commitment = None  # a committing job's proofs.commitment.CommitmentBuilder
        self.replayable = True  # false once it drew by speculative sampling, whose draws nobody replays
        self.verdict = None  # a verify job's proofs.verdicts.VerdictSummary, once its claim is read
        self.grammar = None  # a constrained job's RowGrammar, wherever the job decodes
        self._calls = (ToolCallSplitter(tool_format, [t.as_openai() for t in job.rules.tools])
                       if job.rules.calls_tools and tool_format is not None else None)
        self.prompt_tokens = prompt_tokens
        self.cached_prompt_tokens = cached_prompt_tokens
        self.cached_tier = cached_tier  # the prefix cache's tier they came from: memory | disk
        self.max_tokens = max_tokens
        self.completion_tokens = 0
        self.emitted_ids: list[int] = []
        self.end_token: int | None = None  # the end id that ended it, unemitted: its proof commits to it too
        self.spec_off_reason = spec_off_reason
        self.spec_choice = spec_choice  # auto's numbers when it judged speculation not profitable
        self.spec_stats = None  # a speculating job's SpecTelemetry
        self.prompt_logprobs: tuple | None = None  # a scored prompt's, for its Done
        self._seq = 0
        self._detok = tokenizer.detokenizer
        self._stops = StopMatcher(job.sampling.stop)
        self._eos = end_ids(tokenizer, job.sampling)
        self.t_arrived = arrived
        self.t_started = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.finished = False

    @property
    def end_ids(self) -> set[int]:
        return self._eos

    def token(self, token: int, logprob: TokenLogprob | None = None) -> list[Event]:
        """Take one generated token (with its logprob, when the job asked); return its events (a final `Done`
        when the job ends)."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        if token in self._eos:  # not content; its logprob still goes out (as vLLM's), with no text and no id
            if not self.finished:
                self.end_token = token
            tail = [self._emit("", (), (), (logprob,))] if logprob is not None else []
            return tail + self.finish(FinishReason.STOP)
        self.completion_tokens += 1
        self.emitted_ids.append(token)
        self._detok.add_token(token)
        text, hit_stop = self._stops.feed(self._detok.last_segment)
        events: list[Event] = [self._chunk(text, (token,), (logprob,) if logprob is not None else ())]
        if hit_stop:
            return events + self.finish(FinishReason.STOP, flush=False)
        if self.completion_tokens >= self.max_tokens:
            return events + self.finish(FinishReason.LENGTH)
        return events

    def finish(self, reason: FinishReason, *, flush: bool = True) -> list[Event]:
        if self.finished:
            return []
        self.finished = True
        events: list[Event] = []
        if flush and reason != FinishReason.CANCELLED:
            self._detok.finalize()
            tail, hit_stop = self._stops.feed(self._detok.last_segment)
            tail += "" if hit_stop else self._stops.flush()
            if tail:
                events.append(self._chunk(tail, ()))
        if self._calls is not None and reason != FinishReason.CANCELLED:
            text, calls = self._calls.finish()
            if text or calls:
                events.append(self._emit(text, (), calls))
            if self._calls.calls and reason == FinishReason.STOP:
                reason = FinishReason.TOOL_CALLS
        usage = Usage(self.prompt_tokens, self.completion_tokens, self.cached_prompt_tokens)
        events.append(Done(self.job.id, reason, usage, self.telemetry(reason), self.prompt_logprobs,
                           self._stops.hit, self._proof(), self.verdict))
        return events

    def _proof(self) -> Proof | None:
        if self.commitment is None:
            return None
        sampler = (GREEDY_SAMPLER if self.seed is None else REPLAYABLE_SAMPLER if self.replayable
                   else SPECULATIVE_SAMPLER)
        n, end = len(self.emitted_ids), self.end_token
        # The end token's row is the one after the last emitted token's (rows come in production order, a
        # speculative round's included). Were it missing, the output is still committed to, its end unclaimed.
        data = self.commitment.finish(n + 1) if end is not None else None
        if data is None:
            data, end = self.commitment.finish(n), None
        return Proof(data, sampler, self.seed, end)

    def _chunk(self, text: str, ids: tuple[int, ...], logprobs: tuple = ()) -> Tokens:
        calls = ()
        if self._calls is not None:
            text, calls = self._calls.feed(text)
        return self._emit(text, ids, calls, logprobs)

    def _emit(self, text: str, ids: tuple[int, ...], calls: tuple, logprobs: tuple = ()) -> Tokens:
        ev = Tokens(self.job.id, self._seq, text, ids, calls, logprobs, self.prompt_logprobs if not self._seq else None)
        self._seq += 1
        return ev

    def telemetry(self, finish_reason: FinishReason) -> Telemetry:
        end = time.perf_counter()
        first = self.t_first
        decode_s = (self.t_last - first) if first is not None and self.t_last is not None else 0.0
        # A copy: the job's counters stop here, whatever later touches the row.
        spec = (dataclasses.replace(self.spec_stats) if self.spec_stats
                else SpecTelemetry(SpecMode.OFF, self.spec_off_reason, choice=self.spec_choice))
        computed = self.prompt_tokens - self.cached_prompt_tokens
        return Telemetry(
            finish_reason=finish_reason,
            speculation=spec,
            ttft_ms=round((first - self.t_arrived) * 1000, 3) if first is not None else None,
            queue_ms=round((self.t_started - self.t_arrived) * 1000, 3),
            total_ms=round((end - self.t_arrived) * 1000, 3),
            # Prompt tokens actually computed (a cached prefix costs nothing), over the time to the first token.
            prefill_tokens_per_s=round(computed / (first - self.t_started), 3) if first and first > self.t_started
            else None,
            # Tokens after the first, over the time since the first: the steady decode rate.
            decode_tokens_per_s=round((self.completion_tokens - 1) / decode_s, 3) if decode_s > 0 else None,
            peak_memory_bytes=mx.get_peak_memory(),
            cached_prompt_tokens=self.cached_prompt_tokens, prefix_tier=self.cached_tier,
            constraint=self.job.rules.kind if self.job.rules.constrained else None,
            mask_ms_per_token=(round(self.grammar.mask_s * 1000 / self.grammar.masks, 4)
                               if self.grammar is not None and self.grammar.masks else None),
        )
