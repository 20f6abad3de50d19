"""Verify jobs beside the batches: each reads its claim (prompt + the claimed output) through the model a chunk
per pass (provider.verification.verifier.ClaimReader, by the one prompt reader), oldest first, and ends with
its verdict. Memory sees one as a plain row reading a scored prompt (running.Layout: its KV to the claim's
end, the scoring scratch a chunk's logits take)."""

from __future__ import annotations

from dataclasses import dataclass

from ..jobs import Event, Sink
from ..verdicts import ChunkVerdict, VerdictSummary
from ..models.loader import LoadedModel
from ..types import FinishReason
from ..verification.verifier import Claim, ClaimReader
from .output import JobOutput


@dataclass
class VerifyRead:
    lm: LoadedModel
    output: JobOutput
    sink: Sink
    scorer: ClaimReader  # named as a scored prompt's reader: what memory books for it is the same
    fault: BaseException | None = None


class VerifyReads:
    def __init__(self):
        self._reads: dict[str, VerifyRead] = {}

    def __len__(self) -> int:
        return len(self._reads)

    def job_ids(self) -> list[str]:
        return list(self._reads)

    def rows(self, model_id: str | None = None) -> list[VerifyRead]:
        return [r for r in self._reads.values() if model_id is None or r.lm.id == model_id]

    def add(self, lm: LoadedModel, output: JobOutput, sink: Sink, prompt: list[int], grammar=None) -> None:
        """`grammar`: the job's output rules compiled as for generating it (prompts.CompiledGrammar), or None."""
        job = output.job
        claim = Claim(tuple(prompt), job.verify.output, job.sampling, job.verify.proof)
        self._reads[job.id] = VerifyRead(lm, output, sink, ClaimReader(lm, claim, grammar))

    def step(self, budget: int) -> list[tuple[VerifyRead, list[Event]]]:
        """One chunk of the oldest read; its verdict once it is whole."""
        read = next(iter(self._reads.values()), None)
        if read is None:
            return []
        try:
            read.scorer.step(budget)
            if not read.scorer.done:
                return []
            verdict = read.scorer.verdict().summary()
        except Exception as e:  # this claim's read fails its own job
            read.fault = e
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
        return self._reads.pop(job_id, None)

    def close(self) -> list[VerifyRead]:
        out = list(self._reads.values())
        self._reads.clear()
        return out
