"""A claim checked: prompt + output read through the model in one chunked prefill (the one prompt reader,
engine.prompt_reader), each output position's hidden state met with the node's commitment (`commitment`) and
its token with the distribution it was drawn from (`replay`); then judged by `Tolerance`.

    reader = ClaimReader(lm, claim, grammar)  # grammar: the job's own, compiled as for generating it (or None)
    while not reader.done:
        reader.step(256)
    verdict = reader.verdict()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..engine.grammar import RowGrammar
from ..engine.kv_quant import caches_for
from ..engine.logprobs import SCORE_BYTES_PER_LOGIT
from ..engine.output import end_ids
from ..engine.prompt_reader import SCORE_SCRATCH_BYTES, PromptReader
from ..jobs import SPECULATIVE_SAMPLER, Proof, SamplingParams
from .commitment import CHUNK, ChunkMatch, CommitmentError, decode, match_chunk
from .hidden_tap import install, top_entries
from .replay import GrammarReplay, processed, token_gaps

# Output positions a constrained claim's read takes a pass. Each costs one mask, bounded as a generating row's step
# is (grammar_compile.LIMITS: ~10 ms at worst, ~0.2 ms for a real schema): a pass stalls the batches beside it
# for at most what a batch of this many constrained rows would.
GRAMMAR_POSITIONS = 64


@dataclass(frozen=True)
class Claim:
    """What a node says it did: these output tokens, after this prompt, with this model, drawn as `proof` says."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    sampling: SamplingParams
    proof: Proof


@dataclass(frozen=True)
class Tolerance:
    """How far an honest node's numbers may fall from the verifier's (measured: docs/verification.md).
    rel_tol: a committed value within this relative error of the verifier's counts as matched; min_overlap: a
    chunk fails below this share of matched points; max_mean_err: or when its matched points are off by more
    than this on average (weights 1% off move most values by less than rel_tol, but all of them); tie: a token
    this many nats short of the expected one is a near-tie the two forwards broke apart, not a failure, at most
    max_ties of them; floor: a speculative token less likely than this (nats) under the declared distribution
    fails."""

    rel_tol: float = 0.02
    min_overlap: float = 0.9
    max_mean_err: float = 0.003
    tie: float = 0.02
    max_tie_share: float = 0.05
    floor: float = 18.0


@dataclass
class Verdict:
    passed: bool
    reason: str  # "" when passed; else what failed first
    first_failure: int | None  # the output position where it failed (a chunk's first token for a chunk)
    tokens: int
    chunks: list[ChunkMatch] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # per output position (replay.token_gaps)
    ties: int = 0
    tied: list[bool] = field(default_factory=list)  # per output position: within the tie tolerance

    def summary(self) -> dict:
        overlaps = [c.overlap for c in self.chunks]
        return {"passed": self.passed, "reason": self.reason, "first_failure": self.first_failure,
                "tokens": self.tokens, "chunks": len(self.chunks),
                "min_overlap": min(overlaps) if overlaps else None,
                "max_rel_err": max((c.max_rel_err for c in self.chunks), default=None),
                "max_gap": max(self.gaps, default=None), "ties": self.ties,
                "per_chunk": [{"start": c.start, "overlap": c.overlap, "max_rel_err": c.max_rel_err,
                               "mean_rel_err": c.mean_rel_err,
                               "max_gap": max(self.gaps[c.start:c.start + CHUNK], default=None),
                               "ties": sum(self.tied[c.start:c.start + CHUNK])} for c in self.chunks]}


class ClaimReader:
    """Reads a claim's prompt + output (all but the last token; an output that ended on an end token, per its
    proof, ends with that token, judged like the others) through `lm`'s model, a chunk a step.
    `grammar`: the job's output rules compiled for this model (prompts.CompiledGrammar, from the job itself,
    never from the claim), when generating it would have masked its tokens. `cache` and `read`: caches already
    holding the first `read` prompt tokens (a prompt with images, read by the engine's vision prefill as the
    producer's was), at most all but the prompt's last: every output position is read here."""

    def __init__(self, lm, claim: Claim, grammar=None, *, cache: list | None = None, read: int = 0):
        self.lm, self.claim = lm, claim
        ends = end_ids(lm.tokenizer, claim.sampling)
        self._grammar = None if grammar is None else GrammarReplay(RowGrammar.of(grammar, lm.logits_width, ends))
        self._tap = install(lm.model)
        # The tokens judged: the output, then the end token the proof says the model chose after it, read and
        # judged like any token (its row is the commitment's next). One that is not an end id of this job is
        # never read (it may be any uint32): the verdict fails at its position.
        end = claim.proof.end_token
        self._bad_end = end is not None and end not in ends
        self.tokens = tuple(claim.output) + ((end,) if end is not None and not self._bad_end else ())
        self._sequence = list(claim.prompt) + list(self.tokens)
        self._first = len(claim.prompt) - 1  # the position whose forward gives output token 0
        most = max(1, SCORE_SCRATCH_BYTES // max(1, lm.logits_width * SCORE_BYTES_PER_LOGIT))
        if not 0 <= read <= max(0, self._first):
            raise ValueError(f"{read} tokens read past the claim's first output position")
        self.reader = PromptReader(self._sequence, caches_for(lm) if cache is None else cache, self._forward,
                                   read=read, most=most)
        self._indices: list[np.ndarray] = []
        self._bits: list[np.ndarray] = []
        self._gaps: list[np.ndarray] = []
        self._pending: tuple = ()
        if self._tap is None:
            raise CommitmentError(f"{lm.id}: this model's family has no final norm to read a hidden state from")

    @property
    def done(self) -> bool:
        return self.reader.done or not self.tokens or self._bad_end  # a bad end fails it, whatever is read

    def step(self, tokens: int) -> None:
        if self._grammar is not None:  # its walk runs on the engine thread beside the batches: a few positions a pass
            tokens = min(tokens, max(0, self._first - self.reader.read) + GRAMMAR_POSITIONS)
        start, end = self.reader.step(tokens)
        if self._pending:
            indices, bits, gaps = self._pending
            self._indices.append(np.array(indices))
            self._bits.append(np.array(bits))
            self._gaps.append(np.array(gaps))
            self._pending = ()

    def _forward(self, start: int, end: int) -> list:
        logits = self.lm.model(mx.array(self._sequence[start:end])[None], cache=self.reader.cache)[0]
        lo = max(start, self._first)
        if lo >= end:
            return []
        hidden = self._tap.last[0, lo - start:]
        logits = logits[lo - start:]
        j0, j1 = lo - self._first, end - self._first  # output positions of this chunk
        c = self.claim
        tokens = list(self.tokens[j0:j1])
        masks = None if self._grammar is None else self._grammar.masks(tokens, j0)
        logprobs = processed(logits, c.sampling, self._sequence, lo + 1, masks)
        gaps = token_gaps(logprobs, tokens, list(range(j0, j1)), c.sampling, c.proof.sampler, c.proof.seed,
                          self.lm.decodable)
        self._pending = (*top_entries(hidden), gaps)
        return list(self._pending)

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """The top entries [n, K] it read for each output position (what an honest commitment is built from:
        also what a forger with the real weights can compute for any output, which the token checks answer)."""
        return np.concatenate(self._indices), np.concatenate(self._bits)

    def verdict(self, tolerance: Tolerance = Tolerance()) -> Verdict:
        n = len(self.tokens)
        gaps = np.concatenate(self._gaps).astype(float) if self._gaps else np.zeros(0)
        chunks: list[ChunkMatch] = []
        commitment = self.claim.proof.commitment
        if self._bad_end:
            j = len(self.claim.output)
            return Verdict(False, f"output token {j} ({self.claim.proof.end_token}) is claimed to end the output but"
                           " is not one of this job's end ids", j, n + 1, gaps=list(gaps))
        if commitment is None:
            return Verdict(False, "no commitment", 0, n, gaps=list(gaps))
        try:
            polys = decode(commitment, n)
        except CommitmentError as e:
            return Verdict(False, f"commitment unreadable: {e}", 0, n, gaps=list(gaps))
        indices = np.concatenate(self._indices) if self._indices else np.zeros((0, 0))
        bits = np.concatenate(self._bits) if self._bits else np.zeros((0, 0))
        for i, (modulus, coeffs) in enumerate(polys):
            s = slice(i * CHUNK, min(n, (i + 1) * CHUNK))
            chunks.append(match_chunk(i * CHUNK, modulus, coeffs, indices[s], bits[s], self._tap.hidden_size,
                                      tolerance.rel_tol))
        return judge(n, chunks, gaps, self.claim.proof.sampler, tolerance,
                     self._grammar.failure if self._grammar is not None else None)


def judge(tokens: int, chunks: list[ChunkMatch], gaps: np.ndarray, sampler: str, tolerance: Tolerance,
          grammar: tuple[int, str] | None = None) -> Verdict:
    """The verdict from the numbers alone: the first chunk under min_overlap or over max_mean_err, the first
    token past its tie (or for a speculative draw, below the floor), the token where the claim left its grammar
    (`grammar`: its position and why), too many near-ties."""
    plausible_only = sampler == SPECULATIVE_SAMPLER
    limit = tolerance.floor if plausible_only else tolerance.tie
    bad_tokens = [j for j, g in enumerate(gaps) if not (g <= limit)]
    tied = np.zeros(len(gaps), bool) if plausible_only else (gaps > 0) & (gaps <= limit)
    ties = int(tied.sum())
    bad_chunks = [c.start for c in chunks
                  if c.overlap < tolerance.min_overlap or c.mean_rel_err > tolerance.max_mean_err]
    # At one position, the grammar's reason before the token's (a forbidden token is also -inf: not the model's).
    failures = sorted([(j, "token") for j in bad_tokens] + [(j, "hidden state") for j in bad_chunks]
                      + ([(grammar[0], "grammar")] if grammar is not None else []))
    out = Verdict(True, "", None, tokens, chunks, [float(g) for g in gaps], ties, [bool(t) for t in tied])
    if failures:
        out.passed, out.first_failure = False, failures[0][0]
        j, kind = failures[0]
        out.reason = (f"output token {j} is not the model's" if kind == "token" else grammar[1] if kind == "grammar"
                      else f"the hidden states of tokens {j}.. do not match the commitment")
    elif ties > max(1, math.ceil(tolerance.max_tie_share * tokens)):
        out.passed, out.reason, out.first_failure = False, f"{ties} near-ties in {tokens} tokens", 0
    return out
