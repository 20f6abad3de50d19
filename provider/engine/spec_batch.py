"""One model's speculating jobs, advanced together: each `step()` reads at most one prompt chunk of a row
still reading its prompt, gives every row whose prompt is read its first token (one forward over their
last prompt tokens), then runs one speculative round (provider.engine.spec_rounds) over every row
that decodes: their drafts together, one batched verify forward, each row's own acceptance and rollback.

Rows join (after their prompt is read) and leave (finished, cancelled) between rounds. A round's tokens
go out in one step, through the row's JobOutput, which may end the row part-way through them (a stop
string, max_tokens). Rows planned with different k run one round per k. A job's prefix-cache hit seeds its
target caches, and its K/V goes back to the prefix cache when it ends. When auto judges that its model's
jobs decode faster plain (more of them arrived), the rows it chose to speculate leave for the plain batch
with their caches (`demote`), and continue there exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..outputs import Event, Sink
from ..models.loader import LoadedModel
from ..speculation import SpecPlan
from .acceptance import SampledChoice, choice_for
from .output import JobOutput
from .prefill_plan import read_chunk
from .prefix_cache import COMPLETION, PrefixCache
from .proposers import drafter_for
from .kv_quant import caches_for
from .logprobs import LogprobRequest
from .spec_rounds import SpecRow, Speculator
from ..telemetry import SpecTelemetry


@dataclass
class Row:
    output: JobOutput
    sink: Sink
    spec: SpecRow
    auto: bool  # auto chose to speculate (not `on`): it may go back to plain decoding
    fault: BaseException | None = None  # its output raised: it fails alone


class SpecBatch:
    def __init__(self, lm: LoadedModel, prefix: PrefixCache, *, step_tokens: int, drafter=None):
        """`drafter`: the pair's own (drafters.drafter_for) unless given (a node group's, provider.group.drafts)."""
        self.model_id = lm.id
        self.lm = lm
        self._profile = lm.spec_profile
        self._decodable = lm.decodable
        self._speculator = Speculator(lm.model, drafter or drafter_for(lm), lambda: caches_for(lm))
        self.prefix = prefix
        self._budget = step_tokens  # a prompt is read beside decoding rows by the one chunk rule (prefill_plan)
        self._rows: dict[str, Row] = {}  # by job id, in arrival order

    def __len__(self) -> int:
        return len(self._rows)

    def job_ids(self) -> list[str]:
        return list(self._rows)

    def rows(self) -> list[Row]:
        return list(self._rows.values())

    def add(self, output: JobOutput, sink: Sink, prompt: list[int], plan: SpecPlan, *, cache, cached: int) -> None:
        stats = SpecTelemetry(plan.mode, k=plan.k, choice=plan.choice)
        output.spec_stats = stats
        # A job given a seed replays exactly (coupled draws); one without keeps speculative sampling's acceptance.
        choice = choice_for(output.job.sampling, self._decodable,
                            seed=output.seed if output.job.sampling.seed is not None else None)
        output.replayable = output.replayable and not isinstance(choice, SampledChoice)
        spec = self._speculator.new_row(prompt, stats=stats, choice=choice, caches=cache, cached=cached,
                                        grammar=output.grammar, logprobs=LogprobRequest.of(output, self.lm),
                                        commit=output.commitment is not None)
        self._rows[output.job.id] = Row(output, sink, spec, auto=plan.choice is not None)

    def step(self) -> list[tuple[Row, list[Event]]]:
        out: list[tuple[Row, list[Event]]] = []
        ended: list[Row] = []
        decoding = [row for row in self._rows.values() if not row.spec.reading]
        reading = next((row for row in self._rows.values() if not row.spec.read_all_but_last), None)
        if reading is not None:
            self._speculator.read(reading.spec, read_chunk(reading.spec.left, self._budget, len(decoding)))
        starting = [row for row in self._rows.values() if row.spec.reading and row.spec.read_all_but_last]
        for row in starting:
            job = row.output.job  # the first of n choices (the others take its prompt's KV, all of it but the last
            if job.share_prompt or self.prefix.wants_whole_prompt(len(row.spec.prompt), job.prefix_scope):  # token
                self.prefix.share(row.spec.prompt[:-1], row.spec.caches, job.prefix_scope)  # now), or one for disk
        if starting:  # their last prompt tokens in one forward, which gives each its first token
            for row, first in zip(starting, self._speculator.begin([row.spec for row in starting])):
                out.append((row, self._emit(row, [first], ended)))
        by_k: dict[int, list[Row]] = {}
        for row in decoding:
            by_k.setdefault(row.spec.k, []).append(row)
        for rows in by_k.values():
            for row, tokens in zip(rows, self._speculator.round([row.spec for row in rows])):
                out.append((row, self._emit(row, tokens, ended)))
        for row in ended:  # the step committed: only now do ended rows leave, so a failure above loses none
            self._end(row)
        return out

    def _emit(self, row: Row, tokens: list[int], ended: list[Row]) -> list[Event]:
        events: list[Event] = []
        if row.spec.grammar is not None and row.spec.grammar.error is not None:
            row.fault = row.spec.grammar.error  # its grammar stopped: these tokens are not its grammar's
            return []
        logprobs = row.spec.emitted_logprobs or [None] * len(tokens)
        if row.spec.emitted_entries is not None and row.output.commitment is not None:
            row.output.commitment.add(*row.spec.emitted_entries)
        try:
            for token, logprob in zip(tokens, logprobs):
                events += row.output.token(token, logprob)
                if row.output.finished:
                    ended.append(row)
                    break
        except Exception as e:  # this row's output (its detokenizer, its stop strings) fails it alone
            row.fault = e
            return []
        return events

    def faults(self) -> list[tuple[Row, BaseException]]:
        """Rows whose output raised in the last step; removed from the batch."""
        bad = [row for row in self._rows.values() if row.fault is not None]
        for row in bad:
            del self._rows[row.output.job.id]
            self._observe(row)
        return [(row, row.fault) for row in bad]

    def demote(self) -> list[Row]:
        """Take out the rows auto chose to speculate, for the plain batch to continue from their caches
        (`continuation`)."""
        rows = [row for row in self._rows.values() if row.auto]
        for row in rows:
            del self._rows[row.output.job.id]
            self._observe(row)
        return rows

    @staticmethod
    def continuation(row: Row) -> tuple[list[int], int]:
        """A demoted row's prompt for the plain batch, and how many of its tokens its caches hold: the part
        of the prompt read so far, or once decoding, every committed token and the last one emitted."""
        spec = row.spec
        return (list(spec.prompt), spec.read) if spec.reading else (spec.tokens + [spec.last], len(spec.tokens))

    def cancel(self, job_id: str) -> Row | None:
        row = self._rows.get(job_id)
        if row is not None:
            self._end(row)
        return row

    def close(self) -> list[Row]:
        """Drop every row (their jobs are the caller's to end)."""
        rows = list(self._rows.values())
        self._rows.clear()
        return rows

    def _end(self, row: Row) -> None:
        del self._rows[row.output.job.id]
        spec = row.spec
        if not spec.reading:
            job = row.output.job
            self.prefix.store(spec.tokens, spec.caches, COMPLETION, job.prefix_scope, claim=job.id)
        self._observe(row)

    def _observe(self, row: Row) -> None:
        if self._profile is not None:  # what this job saw keeps auto's estimate current
            stats = row.spec.stats
            self._profile.observe(stats.sampling_scheme, stats.accepted, stats.judged)
