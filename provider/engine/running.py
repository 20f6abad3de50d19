"""The jobs running now, and one pass over them: per model, one batched step of its plain rows
(provider.engine.plain_batch), then one speculative round of its speculating rows (provider.engine.spec_batch);
with each resident model's prefix cache.

Engine thread only. The scheduler decides what starts; this runs it and returns the events. Whatever a job
raises fails that job; a failure inside a forward shared by a batch fails that batch's jobs, not the node.
"""

from __future__ import annotations

import secrets

from .. import logs
from ..jobs import Job, JobError
from ..outputs import Error, Event, Sink
from ..types import Cause, FinishReason, SpecReason
from ..models.loader import LoadedModel
from ..speculation import SpecPlan
from ..status import QueueStatus
from ..models.tool_format import ToolFormat
from ..media.plan import MediaPlan
from ..prompts import CompiledGrammar
from ..proofs.commitment import CommitmentBuilder
from .grammar import GrammarProcessor, RowGrammar
from .batch_layout import Layout, held_bytes, layout_of, with_one_more
from .plain_batch import PlainBatch
from .prompt_reader import PREFILL_ROWS
from .output import JobOutput
from . import sampling
from .prefix_cache import DISK, PrefixCache
from .prefix_disk import DiskTier
from .spec_batch import SpecBatch
from .verify_reads import VerifyReads
from .vision_prefill import MediaRead, MediaReads
from .collective import collective_failure

Delivery = tuple[list[Event], Sink]
log = logs.get("engine")


class Running:
    drafter = staticmethod(lambda lm: None)  # a model's speculating rows' drafter: None, its own (groups: their own)

    def __init__(self, stats: QueueStatus, *, step_tokens: int, max_rows: int, prefix_cache_bytes: int,
                 commit: bool = False, prefix_disk: DiskTier | None = None, read_claim=None):
        self._step_tokens = step_tokens
        self._commit = commit  # every job's outcome carries a proof (provider.verification)
        self._max_rows = max_rows
        self._prefix_cache_bytes = prefix_cache_bytes
        self._prefix_disk = prefix_disk  # the prefix caches' disk tier, shared by every model (or none)
        self._batches: dict[str, PlainBatch] = {}  # by model id: the jobs that decode together
        self._speculating: dict[str, SpecBatch] = {}  # by model id: the jobs that speculate together
        self.prefixes: dict[str, PrefixCache] = {}  # by model id, while it is resident (written on this thread)
        self._media = MediaReads()  # jobs with images or video, read before they join a batch
        self._verifying = VerifyReads(read_claim)  # verify jobs: claims read back by the verifier's reader
        self.stats = stats  # the engine's (EngineStats): batch and prefix-reuse counters are added to it here

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._groups())

    def job_ids(self) -> list[str]:
        """The jobs the batches hold rows for: the one record of what runs (the engine's books check it)."""
        return [job_id for rows in self._groups() for job_id in rows.job_ids()]

    def on_model(self, model_id: str) -> int:
        return sum(len(rows) for rows in (self._batches.get(model_id), self._speculating.get(model_id)) if rows) \
            + len(self._media.rows(model_id)) + len(self._verifying.rows(model_id))

    def _groups(self) -> list:
        return [*self._batches.values(), *self._speculating.values(), self._media, self._verifying]

    # --- what the batches will hold ---------------------------------------------------

    def booked_bytes(self, model_id: str) -> int:
        """What the model's batches will hold: KV when every row they run now reaches its final length, and the
        scratch of reading the prompts still being read (engine.batch_layout)."""
        rows = self._batches.get(model_id) or self._speculating.get(model_id) or next(
            iter(self._media.rows(model_id) + self._verifying.rows(model_id)), None)
        return self._held(rows.lm, *self._layout(model_id)) if rows is not None else 0

    def booking_with(self, lm: LoadedModel, prompt: int, final: int, scored: bool = False,
                     media: MediaPlan | None = None) -> int:
        """The same with one more job, wherever it will decode (batch_layout.with_one_more)."""
        return max(self._held(lm, p, s) for p, s in with_one_more(lm, *self._layout(lm.id), prompt, final, scored,
                                                                  media))

    def models(self) -> set[str]:
        return set(self._batches) | set(self._speculating) | {r.lm.id for r in self._media.rows()} \
            | {r.lm.id for r in self._verifying.rows()}

    def _layout(self, model_id: str) -> tuple[Layout, Layout]:
        """The model's plain rows and speculating rows; a row still reads its prompt until its first token."""
        plain, spec = self._batches.get(model_id), self._speculating.get(model_id)
        # Media reads and verify reads: read, not decoding (a verify read as a scored prompt to the claim's end).
        plain_rows = (plain.rows() if plain else []) + self._media.rows(model_id) + self._verifying.rows(model_id)
        layout = layout_of(plain_rows, lambda r: r.output.t_first is None)
        layout.copying = plain.copying if plain else 0
        reads = self._media.rows(model_id) + self._verifying.rows(model_id)  # a claim's images are read alike
        layout.media = sum(r.held_bytes for r in reads)
        layout.vision = max((r.scratch_bytes for r in reads), default=0)
        return layout, layout_of(spec.rows() if spec else [], lambda r: r.spec.reading)

    def _held(self, lm: LoadedModel, plain: Layout, spec: Layout) -> int:
        return held_bytes(lm, plain, spec, step_tokens=self._step_tokens, prefix_cache_bytes=self._prefix_cache_bytes)

    # --- starting -----------------------------------------------------------------

    def start(self, job: Job, sink: Sink, lm: LoadedModel, prompt: list[int], *, max_tokens: int, arrived: float,
              plan: SpecPlan, shared_prefix: int, grammar: CompiledGrammar | None = None,
              tool_format: ToolFormat | None = None, vision: MediaPlan | None = None) -> None:
        prefix = self.prefixes.get(lm.id)
        if prefix is None:
            prefix = self.prefixes[lm.id] = PrefixCache.of(lm, self._prefix_cache_bytes, self._prefix_disk)
        # A long prompt of a model whose caches cannot be cut shorter is also kept whole once read, for the disk tier.
        keep_at = (shared_prefix, len(prompt) - 1) if prefix.wants_whole_prompt(len(prompt), job.prefix_scope) \
            else (shared_prefix,)
        # A scored prompt (every position's logits wanted) and a claim (read whole by its verifier) take no prefix.
        cache, cached, tier = (None, 0, "") if job.sampling.prompt_logprobs or job.verify else \
            prefix.lookup(prompt, job.prefix_scope)
        if cached:
            self.stats.prefix_hits += 1
            self.stats.prefix_hit_tokens += cached
            self.stats.prefix_disk_tokens += cached if tier == DISK else 0
        output = JobOutput(job, lm.tokenizer, prompt_tokens=len(prompt), max_tokens=max_tokens, arrived=arrived,
                           cached_prompt_tokens=cached, cached_tier=tier, spec_off_reason=plan.reason,
                           spec_choice=plan.choice, tool_format=tool_format)
        if job.verify is not None:
            self._verifying.add(lm, output, sink, prompt, grammar, vision)  # its grammar and media, as for generating
            return
        if self._commit and lm.hidden_tap is not None:
            output.commitment = CommitmentBuilder(lm.hidden_tap.hidden_size)
        if grammar is not None:
            output.grammar = RowGrammar.of(grammar, lm.logits_width, output.end_ids)
        if vision is None:
            self._join(lm, output, sink, prompt, plan, cache, cached, keep_at)
            return
        if job.sampling.prompt_logprobs:
            raise JobError(Cause.INVALID_REQUEST, "prompt logprobs are not given for prompts with images", "echo")
        # Read a piece per pass beside the batches (the media reads), then it joins as after a prefix hit.
        self._media.add(MediaRead(lm, output, sink, prompt, vision, cache, cached, keep_at=keep_at[-1],
                                  keep=lambda c: prefix.share(prompt[:keep_at[-1]], c, job.prefix_scope),
                                  joining=dict(plan=plan, keep_at=keep_at)))

    def _join(self, lm: LoadedModel, output: JobOutput, sink: Sink, prompt: list[int], plan: SpecPlan, cache,
              read: int, keep_at: tuple[int, ...]) -> None:
        """A job's row into its batch; its caches (`cache`) hold its first `read` prompt tokens."""
        demoting = plan.reason in (SpecReason.NOT_PROFITABLE, SpecReason.BATCH_TOO_LARGE)  # plain pays more now
        if not plan.on and demoting and lm.id in self._speculating:
            for row in self._speculating[lm.id].demote():
                self._continue_plain(lm, row, plan.reason)
        if plan.on:
            spec = self._speculating.get(lm.id)
            if spec is None:
                spec = self._speculating[lm.id] = SpecBatch(lm, self.prefixes[lm.id], step_tokens=self._step_tokens,
                                                            drafter=self.drafter(lm))
            spec.add(output, sink, prompt, plan, cache=cache, cached=read)
        else:
            self._add_plain(lm, output, sink, prompt, cache, cached=read, keep_at=keep_at)

    def _continue_plain(self, lm: LoadedModel, row, reason: str) -> None:
        prompt, cached = SpecBatch.continuation(row)
        self._add_plain(lm, row.output, row.sink, prompt, row.spec.caches if cached else None, cached=cached)
        log.info("speculation_stopped", job_id=row.output.job.id, model=lm.id, reason=reason)

    def _add_plain(self, lm: LoadedModel, output: JobOutput, sink: Sink, prompt: list[int], cache, *,
                   cached: int | None = None, keep_at: tuple[int, ...] = ()) -> None:
        params = output.job.sampling
        processors = sampling.logits_processors_for(params) or []
        if output.grammar is not None:  # last: what the grammar forbids stays forbidden whatever came before
            processors.append(GrammarProcessor(output.grammar, len(prompt)))
        self._plain_batch(lm).add(output, sink, prompt, cache=cache,
                                  sampler=None if params.greedy and lm.decodable is None
                                  else sampling.sampler_for(params, lm.decodable, seed=output.seed,
                                                            start=output.completion_tokens),
                                  processors=processors, keep_at=keep_at, cached=cached)

    def _plain_batch(self, lm: LoadedModel) -> PlainBatch:
        batch = self._batches.get(lm.id)
        if batch is None:
            batch = self._batches[lm.id] = PlainBatch(lm, self.prefixes[lm.id], step_tokens=self._step_tokens,
                                                      max_rows=self._max_rows, prefill_rows=PREFILL_ROWS,
                                                      commit=self._commit)
        return batch

    # --- one pass -------------------------------------------------------------------

    def step(self) -> list[Delivery]:
        out: list[Delivery] = []
        for read in self._media.step(self._step_tokens, idle=not (self._batches or self._speculating),
                                     decoding=self._decoding):
            try:
                self._join(read.lm, read.output, read.sink, read.prompt, read.joining["plan"], read.cache,
                           read.read, read.joining["keep_at"])
            except Exception as e:
                self.cancel(read.output.job.id)  # whatever part of it a batch took
                out.append(([_failed(read.output.job.id, e)], read.sink))
        out += self._faulted(self._media)
        out += [(events, read.sink) for read, events in self._verifying.step(
            self._step_tokens, idle=not (self._batches or self._speculating or len(self._media)))]
        out += self._faulted(self._verifying)
        for model_id, batch in list(self._batches.items()):
            out += self._step_batch(model_id, batch)
        for model_id, spec in list(self._speculating.items()):
            out += self._step_speculating(model_id, spec)
        return out

    def _decoding(self, model_id: str) -> int:
        """The model's rows decoding now: a prompt read beside them reads by the one chunk rule (prefill_plan)."""
        plain, spec = self._batches.get(model_id), self._speculating.get(model_id)
        return (sum(r.output.t_first is not None for r in plain.rows()) if plain else 0) \
            + (sum(not r.spec.reading for r in spec.rows()) if spec else 0)

    def _step_speculating(self, model_id: str, spec: SpecBatch) -> list[Delivery]:
        try:
            results = spec.step()
        except Exception as e:  # a bug or MLX failure in a forward the rows share fails those rows, not the node
            if collective_failure(e):  # unless it is the group's wire: then the node cannot go on
                raise
            log.exception("speculation_step_failed", model=model_id, jobs=spec.job_ids())
            restore_random_state()
            del self._speculating[model_id]
            return [([_failed(row.output.job.id, e)], row.sink) for row in spec.close()]
        out = [(events, row.sink) for row, events in results] + self._faulted(spec)
        if not len(spec):
            del self._speculating[model_id]
        return out

    def _step_batch(self, model_id: str, batch: PlainBatch) -> list[Delivery]:
        try:
            results = batch.step()
        except Exception as e:  # a shared forward failed: every row in it fails, the rest of the node goes on
            if collective_failure(e):  # unless it is the group's wire: then the node cannot go on
                raise
            log.exception("batch_step_failed", model=model_id, jobs=batch.job_ids())
            restore_random_state()
            del self._batches[model_id]
            return [([_failed(row.output.job.id, e)], row.sink) for row in batch.close()]
        if results:
            self.stats.batch_steps += 1
            self.stats.batch_rows += len(results)
        out = [(events, row.sink) for row, events in results] + self._faulted(batch)
        if not len(batch):  # an empty generator holds nothing worth keeping; a new one is cheap
            batch.close()
            del self._batches[model_id]
        return out

    @staticmethod
    def _faulted(rows) -> list[Delivery]:
        """Rows whose own sampler, logits processor or output raised: each fails alone."""
        out = []
        for row, error in rows.faults():
            if isinstance(error, JobError):  # the request's fault (its grammar stopped): no traceback to render
                log.info("job_failed_mid_generation", job_id=row.output.job.id, cause=error.cause.value,
                         param=error.param, error=error.message)
            else:
                log.error("job_step_failed", job_id=row.output.job.id, error=type(error).__name__, exc_info=error)
                restore_random_state()
            out.append(([_failed(row.output.job.id, error)], row.sink))
        return out

    # --- ending ---------------------------------------------------------------------

    def cancel(self, job_id: str) -> Delivery | None:
        """Take a job's row out of its batch; its last events (a cancelled Done), or None if no batch has it."""
        for rows in self._groups():
            row = rows.cancel(job_id)
            if row is not None:
                return row.output.finish(FinishReason.CANCELLED), row.sink
        return None

    def close(self) -> None:
        """The engine's loop has ended (a group's rank 0 tells the other ranks)."""

    def clear(self) -> None:
        self._batches.clear()
        self._speculating.clear()
        self._media.close()
        self._verifying.close()

    # --- prefix caches --------------------------------------------------------------

    @property
    def prefix_bytes(self) -> int:
        return sum(c.nbytes for c in self.prefixes.values())

    def trim_prefix_caches(self, keep: int) -> None:
        """Drop least recently used prefixes, largest caches first, until at most `keep` bytes remain."""
        excess = self.prefix_bytes - keep
        for cache in sorted(self.prefixes.values(), key=lambda c: -c.nbytes):
            if excess <= 0:
                break
            excess -= cache.trim_to(cache.nbytes - excess)

    def keep_prefix_caches_of(self, resident: set[str]) -> None:
        for model_id in [m for m in self.prefixes if m not in resident]:
            del self.prefixes[model_id]  # its KV is of no use without the model


def _failed(job_id: str, e: BaseException) -> Error:
    if isinstance(e, JobError):  # a typed failure of the job's own (its grammar's bounds, say)
        return Error.of(job_id, e)
    return Error(job_id, Cause.INTERNAL, f"generation failed: {type(e).__name__}")


def restore_random_state() -> None:
    """A compiled sampler that raised mid-trace leaves MLX's global random state holding a placeholder,
    and every later draw from it fails; jobs sample from keys of their own, but reseed to be sure."""
    import mlx.core as mx

    mx.random.seed(secrets.randbits(63))
