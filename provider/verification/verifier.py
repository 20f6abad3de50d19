"""A claim checked: prompt + output read through the model in one chunked prefill (the one prompt reader,
engine.prompt_reader), each output position's hidden state met with the node's commitment (`commitment`) and
its token with the distribution its request says it was drawn from (`claim_rules`, `replay`); then judged by
`Tolerance`. What is checked follows from the request, never from the proof; a claim that contradicts its request,
or whose commitment cannot be read, fails before anything is read, and the read stops at the first failing chunk.

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
from ..engine.stops import StopMatcher
from ..jobs import SamplingParams
from ..outputs import SPECULATIVE_SAMPLER, Proof
from ..proofs.verdicts import Tolerance
from .claim_rules import Failure, TokenCheck, length_failure, token_check
from ..proofs.commitment import CHUNK, ChunkMatch, CommitmentError, decode, match_chunk
from ..proofs.hidden_tap import install, top_entries
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
    producer's was), at most all but the prompt's last: every output position is read here.

    `claim.sampling` is the request's own (its seed and max_tokens included): it decides how every token is
    checked, how long the output may be and how it may end (`claim_rules`)."""

    def __init__(self, lm, claim: Claim, grammar=None, *, cache: list | None = None, read: int = 0,
                 tolerance: Tolerance = Tolerance()):
        self.lm, self.claim, self.tolerance = lm, claim, tolerance
        ends = end_ids(lm.tokenizer, claim.sampling)
        self._grammar = None if grammar is None else GrammarReplay(RowGrammar.of(grammar, lm.logits_width, ends))
        self._tap = install(lm.model)
        if self._tap is None:
            raise CommitmentError(f"{lm.id}: this model's family has no final norm to read a hidden state from")
        # The tokens judged: the output, then the end token the proof says the model chose after it, read and
        # judged like any token (its row is the commitment's next). One that is not an end id of this job is
        # never read (it may be any uint32): the verdict fails at its position.
        end = claim.proof.end_token
        self.tokens = tuple(claim.output) + ((end,) if end is not None and end in ends else ())
        self._check: TokenCheck | None = None
        self._polys: list = []
        # The most tokens the request let the node generate; a longer claim is read only that far.
        self._limit = max(0, min(claim.sampling.max_tokens, lm.context_length - len(claim.prompt)))
        self._length: Failure | None = None  # how its length or ending fails the request, found as it is read
        self.failure = self._before_reading(ends)  # what fails the claim unread, whatever the model says
        self._readable = min(len(self.tokens), self._limit)
        self._sequence = list(claim.prompt) + list(self.tokens[:self._readable])
        self._first = len(claim.prompt) - 1  # the position whose forward gives output token 0
        most = max(1, SCORE_SCRATCH_BYTES // max(1, lm.logits_width * SCORE_BYTES_PER_LOGIT))
        if not 0 <= read <= max(0, self._first):
            raise ValueError(f"{read} tokens read past the claim's first output position")
        self.reader = PromptReader(self._sequence, caches_for(lm) if cache is None else cache, self._forward,
                                   read=read, most=most)
        self._indices: list[np.ndarray] = []
        self._bits: list[np.ndarray] = []
        self._gaps: list[np.ndarray] = []
        self._chunks: list[ChunkMatch] = []
        self._pending: tuple = ()

    def _before_reading(self, ends: set[int]) -> Failure | None:
        """The request's checks that need no forward. What fails the claim unread: a sampler or seed the request
        contradicts, a claimed end that is not an end id, a commitment that cannot be read. The length and ending
        the request allows are judged beside the read (`_length`): a token may fail before them."""
        c = self.claim
        check = token_check(c.sampling, c.proof)
        if isinstance(check, Failure):
            return check
        self._check = check
        end = c.proof.end_token
        if end is not None and end not in ends:
            j = len(c.output)
            return Failure(j, f"output token {j} ({end}) is claimed to end the output but is not one of this job's"
                              " end ids")
        if c.proof.commitment is None:
            return Failure(0, "no commitment")
        try:
            self._polys = decode(c.proof.commitment, len(self.tokens))
        except CommitmentError as e:
            return Failure(0, f"commitment unreadable: {e}")
        self._length = length_failure(c.output, end, self._limit, ends,
                                      stop_position(self.lm.tokenizer, c.output[:self._limit + 1], c.sampling.stop))
        return None

    @property
    def done(self) -> bool:
        return self.failure is not None or self.reader.done or not self._readable or self._failed_so_far()

    def step(self, tokens: int) -> None:
        if self.done:
            return
        if self._grammar is not None:  # its walk runs on the engine thread beside the batches: a few positions a pass
            tokens = min(tokens, max(0, self._first - self.reader.read) + GRAMMAR_POSITIONS)
        self.reader.step(tokens)
        if self._pending:
            indices, bits, gaps = self._pending
            self._indices.append(np.array(indices))
            self._bits.append(np.array(bits))
            self._gaps.append(np.array(gaps))
            self._pending = ()
            self._match_chunks()

    def _forward(self, start: int, end: int) -> list:
        logits = self.lm.model(mx.array(self._sequence[start:end])[None], cache=self.reader.cache)[0]
        lo = max(start, self._first)
        if lo >= end:
            return []
        hidden = self._tap.last[0, lo - start:]
        logits = logits[lo - start:]
        j0, j1 = lo - self._first, end - self._first  # output positions of this chunk
        tokens = list(self.tokens[j0:j1])
        masks = None if self._grammar is None else self._grammar.masks(tokens, j0)
        logprobs = processed(logits, self.claim.sampling, self._sequence, lo + 1, masks)
        gaps = token_gaps(logprobs, tokens, list(range(j0, j1)), self.claim.sampling, self._check.sampler,
                          self._check.seed, self.lm.decodable, edge=self.tolerance.tie)
        self._pending = (*top_entries(hidden), gaps)
        return list(self._pending)

    @property
    def _read_positions(self) -> int:
        return sum(len(g) for g in self._gaps)

    def _match_chunks(self) -> None:
        """Each chunk of the commitment against the verifier's own entries, as soon as all its positions are read
        (a chunk reaching past what a too-long claim is read for is never matched: the claim fails at its limit)."""
        read = self._read_positions
        while len(self._chunks) < len(self._polys):
            s = slice(len(self._chunks) * CHUNK, min(len(self.tokens), (len(self._chunks) + 1) * CHUNK))
            if read < s.stop:
                return
            indices, bits = self.entries()
            modulus, coeffs = self._polys[len(self._chunks)]
            self._chunks.append(match_chunk(s.start, modulus, coeffs, indices[s], bits[s], self._tap.hidden_size,
                                            self.tolerance.rel_tol))

    def _judged(self, count_ties: bool = True) -> Verdict:
        gaps = np.concatenate(self._gaps).astype(float) if self._gaps else np.zeros(0)
        known = [(f.position, f.reason) for f in (self._length,) if f is not None]
        if self._grammar is not None and self._grammar.failure is not None:
            known.append(self._grammar.failure)
        return judge(len(self.tokens), self._chunks, gaps, self._check.sampler, self.tolerance, known,
                     count_ties=count_ties)

    def _failed_so_far(self) -> bool:
        """Whether what is read already fails the claim where it fails first: a failing token, grammar or length
        position whose chunk is read whole (a chunk of the hidden states could still fail earlier), or a failing
        chunk. A claim of garbage costs a chunk's read, not the whole output's."""
        if not self._gaps:
            return False
        first = self._judged(count_ties=False).first_failure
        return first is not None and self._read_positions >= min(self._readable, (first // CHUNK + 1) * CHUNK)

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """The top entries [n, K] it read for each output position (what an honest commitment is built from)."""
        return np.concatenate(self._indices), np.concatenate(self._bits)

    def verdict(self) -> Verdict:
        if self.failure is not None:
            f, n = self.failure, len(self.tokens)
            return Verdict(False, f.reason, f.position, max(n, f.position + 1))
        return self._judged()


def read_claim(lm, prompt: list[int], job, grammar=None, *, cache: list | None = None, read: int = 0,
               tolerance: Tolerance = Tolerance()) -> ClaimReader:
    """The reader of verify job `job`'s claim after `prompt` (what the engine, below this package, is handed by
    the node that builds it: provider.engine.verify_reads)."""
    claim = Claim(tuple(prompt), job.verify.output, job.sampling, job.verify.proof)
    return ClaimReader(lm, claim, grammar, cache=cache, read=read, tolerance=tolerance)


def stop_position(tokenizer, output, stops: tuple[str, ...]) -> int | None:
    """The output position whose token first completes one of `stops` in the output's text, as the producer's
    JobOutput saw it (the same streaming detokenizer and matcher, token by token); None if none does."""
    if not stops:
        return None
    detok, matcher = tokenizer.detokenizer, StopMatcher(stops)
    detok.reset()
    for j, t in enumerate(output):
        detok.add_token(t)
        if matcher.feed(detok.last_segment)[1]:
            return j
    return None


def judge(tokens: int, chunks: list[ChunkMatch], gaps: np.ndarray, sampler: str, tolerance: Tolerance,
          known: list[tuple[int, str]] = (), *, count_ties: bool = True) -> Verdict:
    """The verdict from the numbers alone: the first chunk under min_overlap or over max_mean_err, the first
    token past its tie (or for a speculative draw, below the floor), the first of the `known` failures (position,
    why: where the claim left its grammar, a length or ending its request does not allow), too many near-ties
    (unless `count_ties` is off: a verdict so far)."""
    plausible_only = sampler == SPECULATIVE_SAMPLER
    limit = tolerance.floor if plausible_only else tolerance.tie
    bad_tokens = [j for j, g in enumerate(gaps) if not (g <= limit)]
    tied = np.zeros(len(gaps), bool) if plausible_only else (gaps > 0) & (gaps <= limit)
    ties = int(tied.sum())
    bad_chunks = [c.start for c in chunks
                  if c.overlap < tolerance.min_overlap or c.mean_rel_err > tolerance.max_mean_err]
    # At one position, a known reason before the token's (a forbidden token is also -inf: not the model's).
    failures = sorted([(j, 2, f"output token {j} is not the model's") for j in bad_tokens]
                      + [(j, 1, f"the hidden states of tokens {j}.. do not match the commitment") for j in bad_chunks]
                      + [(j, 0, why) for j, why in known])
    out = Verdict(True, "", None, tokens, chunks, [float(g) for g in gaps], ties, [bool(t) for t in tied])
    if failures:
        out.passed, out.first_failure, _, out.reason = False, *failures[0]
    elif count_ties and ties > allowed_ties(tokens, tolerance):  # at the first: where the output left the model's
        out.passed, out.reason, out.first_failure = False, f"{ties} near-ties in {tokens} tokens", int(tied.argmax())
    return out


def allowed_ties(tokens: int, tolerance: Tolerance) -> int:
    """Near-ties an honest output of `tokens` may show: a share of its length, rounded down, so none below the
    length where the share is less than one (each tie is a token the producer could have chosen freely), unless
    the profile's backend shows honest ties even there (`min_ties`)."""
    return max(tolerance.min_ties, math.floor(tolerance.max_tie_share * tokens + 1e-9))
