"""One model's running jobs, advanced together: each `step()` is one batched decode forward over every
decoding row plus at most one prefill forward over the prompts being read, within the step's token budget
(provider.engine.prefill_plan decides whose prompt and how much).

The batching is mlx-lm's `BatchGenerator` (batch KV caches with left padding, rotating caches for sliding
windows, rows joining and leaving between steps, per-row samplers and logits processors). Around it, for
what it does not do:
- text stop strings, seen only by the detokenized text (JobOutput), end a row from here;
- a sampler or logits processor that raises fails its own row, not the forward every row shares;
- the KV of finished rows, and of shared system prompts as soon as they are read, goes to the prefix cache;
- logprobs: a row that reports them records its raw logits as its first logits processor (mlx-lm's own
  logprobs are after the processors, in the model's dtype), and every such row's are read in one pick per
  step, in float32;
- a scored prompt (echo with logprobs) is read a chunk per step by a PromptScorer (the one prompt reader,
  provider.engine.prompt_reader, in the chunk the plan gives it), beside the batch, keeping every position's
  logprobs; the row then joins the batch from the scorer's caches, as from a prefix hit.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, StopSequences

from ..outputs import Event, Sink
from ..models.loader import LoadedModel
from ..types import FinishReason
from .logprobs import LogprobRequest, PromptScorer, log_softmax, pick, read, texts_for
from .output import JobOutput
from .prefill_plan import longest_read, plan_prefill
from .kv_quant import caches_for
from .prefix_cache import SYSTEM, PrefixCache
from ..proofs.hidden_tap import HiddenTap

QUEUED, READING, DECODING = "queued", "reading", "decoding"  # a row's stage in the generator


@dataclass
class Row:
    uid: int
    output: JobOutput
    sink: Sink
    keep_at: tuple[int, ...]  # prompt lengths whose KV is kept once read (a system prefix, the whole prompt)
    fault: BaseException | None = None  # its sampler, logits processor or output raised: it fails alone
    generator_done: bool = False  # the generator removed the row itself (EOS or its max_tokens)
    logprobs: LogprobRequest | None = None
    raw: deque = field(default_factory=deque)  # raw logits recorded by its tap, oldest first (one per token)
    entries: deque = field(default_factory=deque)  # its hidden state's top entries per token, oldest first
    scorer: PromptScorer | None = None  # its prompt is being scored, before it joins the generator
    joining: dict | None = None  # how it joins the generator once scored
    stage: str = QUEUED
    left: int = 0  # prompt tokens still to read (the last one is read by its first decode)


class PlainBatch:
    def __init__(self, lm: LoadedModel, prefix: PrefixCache, *, step_tokens: int, max_rows: int,
                 prefill_rows: int = 8, commit: bool = False):
        self.model_id = lm.id
        self.lm = lm
        # Committing: every row reads its hidden state from the model's tap (hidden_tap: row by row, so all must)
        self._hidden = lm.hidden_tap if commit else None
        self.prefix = prefix
        self._budget = step_tokens
        self._prefill_rows = min(prefill_rows, max_rows)
        # The generator reads what `_plan` gives each step (its prefill_step_size, set per step) in one forward: its
        # prompt batch, made here, cuts a step's read at the size given here, so that is the longest the rule reads.
        self._gen = BatchGenerator(lm.model, completion_batch_size=max_rows, prefill_batch_size=self._prefill_rows,
                                   prefill_step_size=longest_read(step_tokens))
        self._rows: dict[int, Row] = {}
        self._by_job: dict[str, int] = {}
        self._scoring: dict[str, Row] = {}  # by job id: rows whose prompts are being scored, in arrival order
        self._scoring_failed: list[Row] = []  # out of the batch already; `faults` reports them
        # Bytes of the copy the generator's next step makes: rows joined rows already decoding, or left rows that
        # go on, and mlx-lm copies the batch's caches for it (a join pads every row to the longest and
        # concatenates; a leave gathers the rest), lazily, so the copy is held beside them in that step (measured
        # with mx.get_peak_memory: about twice the batch's KV). Its size is the caches' as they will be, which
        # mlx-lm reports from their shapes before they are evaluated. A row joining or leaving alone: none.
        self.copying = 0

    def __len__(self) -> int:
        return len(self._rows) + len(self._scoring)

    def job_ids(self) -> list[str]:
        return [*self._by_job, *self._scoring]

    def add(self, output: JobOutput, sink: Sink, prompt: list[int], *, cache, sampler, processors,
            keep_at: tuple[int, ...], cached: int | None = None) -> None:
        """Queue a row for the whole `prompt`; `cache` holds the KV of its first `cached` tokens (by default
        the job's cached_prompt_tokens; a job that decoded elsewhere first continues with its tokens so far
        as the prompt)."""
        cached = output.cached_prompt_tokens if cached is None else cached
        row = Row(-1, output, sink, (), logprobs=LogprobRequest.of(output, self.lm))
        if row.logprobs is not None:  # first: the logits before any processor changes them
            processors = [_tap(row), *(processors or ())]
        if self._hidden is not None:
            processors = [_hidden_entries(row, self._hidden), *(processors or ())]
        if output.job.sampling.prompt_logprobs and output.t_first is None:
            row.scorer = PromptScorer(self.lm.model, prompt, output.job.sampling.top_logprobs,
                                      texts_for(self.lm.tokenizer), self.lm.decodable, self.lm.logits_width,
                                      cache=caches_for(self.lm))
            row.joining = dict(prompt=prompt, sampler=sampler, processors=processors, keep_at=keep_at)
            self._scoring[output.job.id] = row
            return
        self._insert(row, prompt, cache, cached, sampler, processors, keep_at)

    def _insert(self, row: Row, prompt: list[int], cache, cached: int, sampler, processors,
                keep_at: tuple[int, ...]) -> None:
        output = row.output
        rest = prompt[cached:]
        # A segment per prefix to keep that remains to compute (a system prefix, the whole prompt for the disk
        # tier): the generator stops at each one's end, and its KV is kept then, before the rest is read.
        cuts = sorted({k - cached for k in keep_at if 0 < k - cached < len(rest)})
        segments = [rest[a:b] for a, b in zip([0, *cuts], [*cuts, len(rest)])]
        # A row with no cached prefix starts from fresh caches of the model's KV precision (kv_quant.caches_for),
        # not the ones mlx-lm would make for it.
        cache = cache if cache is not None else caches_for(self.lm)
        row.uid = self._gen.insert_segments(
            [segments], max_tokens=[output.max_tokens - output.completion_tokens], caches=[cache], all_tokens=[prompt[:cached]],
            samplers=[None if sampler is None else _guarded_sampler(sampler, row)],
            logits_processors=[[_guarded_processor(p, row) for p in processors or ()]],
            stop_sequences=[StopSequences([[t] for t in sorted(output.end_ids)])])[0]
        row.keep_at = tuple(cached + c for c in cuts)
        row.stage, row.left = QUEUED, len(rest) - 1
        self._rows[row.uid] = row
        self._by_job[output.job.id] = row.uid

    def step(self) -> list[tuple[Row, list[Event]]]:
        """One generator step; the events of every row that produced something."""
        out = self._score(self._plan())
        decoding = self._decoding()
        prompt_responses, gen_responses = self._gen.next()
        for r in prompt_responses:
            if (row := self._rows.get(r.uid)) is not None:
                done, total = r.progress
                row.stage, row.left = (DECODING, 0) if r.end_of_prompt else (READING, max(0, total - done - 1))
        self._keep_system_prefixes(prompt_responses)
        logprobs = self._logprobs(gen_responses)
        self._commit_entries(gen_responses)
        dropped, ended = [], []  # rows the generator removed itself; rows a stop string ended
        for r in gen_responses:
            row = self._rows.get(r.uid)
            if row is None or row.fault is not None:
                continue  # a faulted row is reported by `faults`
            row.generator_done = r.finish_reason is not None
            try:
                events = row.output.token(r.token, logprobs.get(r.uid))
                if row.generator_done and not row.output.finished:  # its own length rule ended it first
                    events += row.output.finish(FinishReason.LENGTH)
            except Exception as e:  # this row's output (its detokenizer, its stop strings) fails it alone
                row.fault = e
                continue
            if row.output.finished:
                (dropped if row.generator_done else ended).append((row, r))
            out.append((row, events))
        # The step committed: only now do ended rows leave, so a failure above loses none of them.
        for row, r in dropped:
            self._forget(row)
            self.prefix.store(r.all_tokens, r.prompt_cache, scope=row.output.job.prefix_scope, claim=row.output.job.id)
        if ended:
            caches = self._gen.remove([r.uid for _, r in ended], return_prompt_caches=True)
            for row, r in ended:
                self._forget(row)
                cache, tokens = caches.get(r.uid, (None, None))
                if cache:
                    self.prefix.store(tokens, cache, scope=row.output.job.prefix_scope, claim=row.output.job.id)
        after = self._decoding()
        self._copy_pending(bool(decoding) and bool(after) and after != decoding)
        return out

    def _copy_pending(self, pending: bool) -> None:
        self.copying = self._gen.prompt_cache_nbytes if pending else 0

    def _decoding(self) -> set[int]:
        return {uid for uid, row in self._rows.items() if row.stage == DECODING}

    def faults(self) -> list[tuple[Row, BaseException]]:
        """Rows whose sampler, logits processor or output raised in the last step; removed from the batch."""
        bad = [row for row in self._rows.values() if row.fault is not None]
        if bad:
            live = [row.uid for row in bad if not row.generator_done]
            if live:
                self._gen.remove(live)
                self._copy_pending(len(self._rows) > len(bad))
            for row in bad:
                self._forget(row)
        bad += self._scoring_failed
        self._scoring_failed = []
        return [(row, row.fault) for row in bad]

    def cancel(self, job_id: str) -> Row | None:
        if job_id in self._scoring:
            return self._scoring.pop(job_id)
        uid = self._by_job.get(job_id)
        if uid is None:
            return None
        self._gen.remove([uid])
        self._copy_pending(len(self._rows) > 1)
        row = self._rows[uid]
        self._forget(row)
        return row

    def rows(self) -> list[Row]:
        return [*self._rows.values(), *self._scoring.values()]

    def close(self) -> list[Row]:
        """Drop every row (their jobs are the caller's to end) and the generator's caches."""
        rows = self.rows()
        self._rows.clear()
        self._scoring.clear()
        self._by_job.clear()
        self._gen.close()
        return rows

    def _forget(self, row: Row) -> None:
        self._rows.pop(row.uid, None)
        self._by_job.pop(row.output.job.id, None)

    def _plan(self) -> int:
        """Set what the generator reads this step (prefill_plan); the tokens a scored prompt may read."""
        by_stage: dict[str, list[int]] = {QUEUED: [], READING: [], DECODING: []}
        for row in self._rows.values():  # in insertion order: the generator's queue is first come, first served
            by_stage[row.stage].append(row.left)
        scoring = next(iter(self._scoring.values()), None)
        reading = by_stage[READING] + ([scoring.scorer.reader.left] if scoring else [])
        plan = plan_prefill(reading, by_stage[QUEUED], len(by_stage[DECODING]), self._budget)
        self._gen.prefill_batch_size = len(by_stage[READING]) + min(plan.join, self._prefill_rows)
        self._gen.prefill_step_size = plan.chunk
        return plan.chunk

    def _score(self, chunk: int) -> list[tuple[Row, list[Event]]]:
        """One chunk of the oldest scored prompt; once read, the row joins the generator (or, asked for no
        tokens, ends with its prompt's logprobs)."""
        row = next(iter(self._scoring.values()), None)
        if row is None:
            return []
        try:
            row.scorer.step(chunk)
            if not row.scorer.done:
                return []
            del self._scoring[row.output.job.id]
            scorer, joining = row.scorer, row.joining
            row.scorer = row.joining = None
            row.output.prompt_logprobs = tuple(scorer.logprobs)
            if row.output.max_tokens <= 0:
                return [(row, row.output.finish(FinishReason.LENGTH))]
            prompt = joining["prompt"]
            if max(joining["keep_at"], default=0) >= len(prompt) - 1:  # its choices to come reuse the prompt's KV
                self.prefix.share(prompt[:-1], scorer.cache, row.output.job.prefix_scope)
            self._insert(row, prompt, scorer.cache, len(prompt) - 1, joining["sampler"], joining["processors"], ())
        except Exception as e:  # this prompt's scoring fails its own job
            self._scoring.pop(row.output.job.id, None)
            row.fault = e
            self._scoring_failed.append(row)
        return []

    def _logprobs(self, gen_responses) -> dict:
        """Each reporting row's TokenLogprob for the token it gives this step, by uid: one pick over them all."""
        rows = [(r, row) for r in gen_responses if (row := self._rows.get(r.uid)) is not None
                and row.logprobs is not None and row.fault is None and row.raw]
        if not rows:
            return {}
        raw = mx.concatenate([row.raw.popleft() for _, row in rows], axis=0)
        tokens = [r.token for r, _ in rows]
        top = max(row.logprobs.top for _, row in rows)
        picked = pick(log_softmax(raw), mx.array(tokens), top, self.lm.decodable)
        mx.eval([a for a in picked if a is not None])
        out = {}
        for (r, row), lp in zip(rows, read(tokens, picked, rows[0][1].logprobs.texts)):
            out[r.uid] = dataclasses.replace(lp, top=lp.top[:row.logprobs.top])
        return out

    def _commit_entries(self, gen_responses) -> None:
        """Each committing row's entries of the token it gives this step (computed a step ago: read back now
        without waiting), before its output takes the token and may end with its proof."""
        rows = [row for r in gen_responses if (row := self._rows.get(r.uid)) is not None and row.entries]
        read: dict[int, tuple] = {}  # each step's [B, K] arrays read once, however many rows they hold (by id: kept)
        for row in rows:
            indices, bits, i = row.entries.popleft()
            if row.output.commitment is not None:
                for a in (indices, bits):
                    if id(a) not in read:
                        read[id(a)] = (a, np.array(a))
                row.output.commitment.add(read[id(indices)][1][i:i + 1], read[id(bits)][1][i:i + 1])

    def _keep_system_prefixes(self, prompt_responses) -> None:
        done = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt
                and r.uid in self._rows and self._rows[r.uid].keep_at]
        if not done:
            return
        for uid, (cache, tokens) in self._gen.extract_cache(done).items():
            row = self._rows[uid]
            if len(tokens) in row.keep_at:
                self.prefix.store(tokens, cache, SYSTEM, row.output.job.prefix_scope)
            row.keep_at = tuple(k for k in row.keep_at if k > len(tokens))


def _guarded_sampler(sampler, row: Row):
    """A sampler that records its failure on its row and returns a placeholder (argmax), so the step shared
    with other rows completes; the engine then fails that row alone and removes it."""

    def sample(logprobs: mx.array) -> mx.array:
        try:
            return sampler(logprobs)
        except Exception as e:
            row.fault = row.fault or e
            return mx.argmax(logprobs, axis=-1)

    return sample


def _tap(row: Row):
    """A logits processor that keeps the row's logits as the model gave them, for its logprobs."""

    def tap(tokens: mx.array, logits: mx.array) -> mx.array:
        row.raw.append(logits)
        return logits

    return tap


def _hidden_entries(row: Row, tap: HiddenTap):
    """A logits processor that keeps the top entries of the row's hidden state at this forward (being computed)."""

    def entries(tokens: mx.array, logits: mx.array) -> mx.array:
        entries = tap.next_row_entries()  # every row takes its own, committing or not: the n-th call is row n
        if row.output.commitment is not None:
            row.entries.append(entries)
        return logits

    return entries


def _guarded_processor(processor, row: Row):
    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            return processor(tokens, logits)
        except Exception as e:
            row.fault = row.fault or e
            return logits

    return process
