"""Verify jobs beside the batches: each reads its claim (prompt + the claimed output) through the model a chunk
per pass (the reader the engine is given: provider.verification.verifier.read_claim, built on the one prompt
reader), oldest first, and ends with its verdict. The engine sits below verification: the node that builds it
hands it the verifier's reader, and an engine given none refuses verify jobs. Memory sees one as a plain row
reading a scored prompt (batch_layout.Layout: its KV to the claim's end, the scoring scratch a chunk's logits take).

A claim whose request has images or video reads its prompt as the job that made it did: by the engine's own
vision prefill (vision_prefill.MediaRead: the same media, prepared again from the request within the same
bounds, each through the checkpoint's tower, the prompt's embeddings with their features in place), a piece a
pass; then the claim's reader goes on from the prompt's last token, where the producer's first decode began.
Until then it holds, and is booked for, what a generating job's media read holds (`held_bytes`,
`scratch_bytes`)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable

from ..jobs import JobError
from ..outputs import Event, Sink
from ..media.plan import MediaPlan
from ..memory.budget import system_facts
from ..proofs.verdicts import ChunkVerdict, VerdictSummary, for_backend, looser
from ..models.loader import LoadedModel
from ..types import Cause, FinishReason
from .output import JobOutput
from .vision_prefill import PIXELS_WAIT_S, MediaRead


@dataclass
class VerifyRead:
    lm: LoadedModel
    output: JobOutput
    sink: Sink
    scorer: Any  # the claim's reader (verifier.ClaimReader), named as a scored prompt's: booked the same
    media: MediaRead | None = None  # its prompt with images, read first into the scorer's caches; None once read
    fault: BaseException | None = None

    @property
    def held_bytes(self) -> int:
        return self.media.held_bytes if self.media is not None else 0

    @property
    def scratch_bytes(self) -> int:
        return self.media.scratch_bytes if self.media is not None else 0

    def close(self) -> None:
        if self.media is not None:
            self.media.close()
            self.media = None


# read_claim(lm, prompt, job, grammar, *, cache, read, tolerance) -> the claim's reader (verifier.read_claim).
ClaimReading = Callable[..., Any]


class VerifyReads:
    def __init__(self, read_claim: ClaimReading | None = None):
        self._read_claim = read_claim
        self._reads: dict[str, VerifyRead] = {}

    def __len__(self) -> int:
        return len(self._reads)

    def job_ids(self) -> list[str]:
        return list(self._reads)

    def rows(self, model_id: str | None = None) -> list[VerifyRead]:
        return [r for r in self._reads.values() if model_id is None or r.lm.id == model_id]

    def add(self, lm: LoadedModel, output: JobOutput, sink: Sink, prompt: list[int], grammar=None,
            vision: MediaPlan | None = None) -> None:
        """`grammar`: the job's output rules compiled as for generating it (prompts.CompiledGrammar), or None;
        `vision`: the request's images or video, planned as for generating it (prompts.Prepared.vision), or None."""
        job = output.job
        if self._read_claim is None:
            raise JobError(Cause.INVALID_REQUEST, "this engine was built without a claim reader: it runs no verify "
                           "jobs", "verify")
        # What this backend needs for this checkpoint, loosened to the coordinator's choice for both nodes' backends.
        own = for_backend(system_facts().backend, bfloat16=_bfloat16(lm))
        tolerance = looser(job.verify.tolerance, own) if job.verify.tolerance is not None else own
        if vision is None:
            self._reads[job.id] = VerifyRead(lm, output, sink, self._read_claim(lm, prompt, job, grammar,
                                                                                tolerance=tolerance))
            return
        # Raises, typed, for a model whose tower is not loaded, before anything is prepared.
        media = MediaRead(lm, output, sink, prompt, vision, None, 0, joining={})
        scorer = self._read_claim(lm, prompt, job, grammar, cache=media.cache, read=len(prompt) - 1,
                                  tolerance=tolerance)
        self._reads[job.id] = VerifyRead(lm, output, sink, scorer, media)

    def step(self, budget: int, idle: bool = False) -> list[tuple[VerifyRead, list[Event]]]:
        """One piece of the oldest read (an image through the tower, a chunk of its prompt or of its claim); its
        verdict once it is whole. `idle`: nothing else runs this pass, so pixels still being prepared are waited
        for a moment rather than the engine spinning."""
        read = next(iter(self._reads.values()), None)
        if read is None:
            return []
        try:
            if read.media is not None and read.scorer.failure is not None:
                read.close()  # a claim that fails unread needs no prompt read
            if read.media is not None:
                waiting = read.media.waiting
                if waiting is not None and idle:
                    concurrent.futures.wait([waiting], timeout=PIXELS_WAIT_S)
                read.media.advance(budget)
                if read.media.done:
                    read.media = None  # its embeddings go; its caches are the scorer's
                return []
            read.scorer.step(budget)
            if not read.scorer.done:
                return []
            verdict = read.scorer.verdict().summary()
        except Exception as e:  # this claim's read (its images included) fails its own job
            read.fault = e
            read.close()
            return []
        del self._reads[read.output.job.id]
        chunks = tuple(ChunkVerdict(**c) for c in verdict["per_chunk"])
        read.output.verdict = VerdictSummary(**verdict | {"per_chunk": chunks})
        return [(read, read.output.finish(FinishReason.STOP, flush=False))]

    def faults(self) -> list[tuple[VerifyRead, BaseException]]:
        bad = [r for r in self._reads.values() if r.fault is not None]
        for r in bad:
            del self._reads[r.output.job.id]
        return [(r, r.fault) for r in bad]

    def cancel(self, job_id: str) -> VerifyRead | None:
        read = self._reads.pop(job_id, None)
        if read is not None:
            read.close()
        return read

    def close(self) -> list[VerifyRead]:
        out = list(self._reads.values())
        for read in out:
            read.close()
        self._reads.clear()
        return out


def _bfloat16(lm: LoadedModel) -> bool:
    """Whether the model computes in bfloat16 (its first floating parameter's dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return next((a.dtype == mx.bfloat16 for _, a in tree_flatten(lm.model.parameters())
                 if mx.issubdtype(a.dtype, mx.floating)), False)
