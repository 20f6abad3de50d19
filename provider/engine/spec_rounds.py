"""Speculative decoding rounds over one or many sequences: draft k tokens per row, verify k+1 positions of
every row in one batched target forward, keep each row's accepted prefix plus one token from the target,
roll each row's caches back exactly.

Lossless for greedy and sampled rows alike (`acceptance`: greedy matching, or speculative sampling). Greedy:
the target's argmax is computed exactly as mlx-lm's plain path computes it (log-softmax, then argmax). On
MLX's CPU build with its reference BLAS a row of a width-(k+1) forward equals the width-1 row bit for bit; a
BLAS or GPU kernel that rounds another width otherwise (OpenBLAS, Metal) moves a logit by float rounding
(~1e-5), which changes a greedy token only at such a near-tie. The host reads values back once per round.

Each row owns plain per-sequence caches (KVCache, RotatingKVCache, or kv_quant's QuantizedKVRow and
QuantizedRotatingKVRow for a model served with quantized KV), whose rollback is exact. A round over
several rows merges them into batch caches (left-padded to the longest row), runs the drafter and
the verify forward on those, and extracts each row's caches back, so rows join and leave between rounds
freely and each keeps its own acceptance length. The merge copies the rows' K/V once per round; a lone row
uses its caches directly.

mlx-lm's own speculative loop is not used: `trim_prompt_cache` silently trims nothing from a
RotatingKVCache once the context passes the sliding window, so Gemma 4 diverges there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from ..models.gemma4_target import Target
from ..telemetry import SpecTelemetry
from . import recurrent
from .acceptance import GreedyChoice
from .grammar import masked
from .logprobs import log_softmax, pick, read
from .prompt_reader import PromptReader
from ..proofs.hidden_tap import top_entries


@dataclass
class SpecRow:
    """One sequence decoding speculatively. Its caches hold the K/V of every committed token but `last`,
    the next round's first input; `hidden` is the target's final-norm hidden state that produced `last`."""

    prompt: list[int]
    choice: Any  # acceptance.GreedyChoice or SampledChoice: how this row drafts and judges
    stats: SpecTelemetry
    caches: list
    read: int = 0  # prompt tokens in the caches while the prompt is being read
    drafter_read: int = 0  # of those, the ones the drafter has read too (a cached prefix it reads in chunks)
    last: int | None = None  # None while the prompt is being read
    hidden: mx.array | None = None
    draft: Any = None  # the drafter's own state for this row (a draft model's caches and pending tokens)
    tokens: list[int] = field(default_factory=list)  # what the caches hold K/V for, in order
    grammar: Any = None  # a constrained row's grammar.RowGrammar: drafts and verdicts drawn under its masks
    logprobs: Any = None  # a row that reports logprobs: its LogprobRequest (top, texts, limit)
    emitted_logprobs: list = field(default_factory=list)  # the TokenLogprobs of the tokens the last call gave
    commit: bool = False  # its outcome carries a commitment: keep its hidden state's top entries per token
    emitted_entries: tuple | None = None  # (indices, bits) [n, K] of the tokens the last call gave, when it commits

    @property
    def committed(self) -> int:
        """K/V rows in the caches."""
        return len(self.tokens)

    @property
    def k(self) -> int:
        return self.stats.k

    @property
    def position(self) -> int:
        """The output position of the row's next token (0: its first)."""
        return len(self.tokens) + 1 - len(self.prompt)

    @property
    def reading(self) -> bool:
        return self.last is None

    @property
    def left(self) -> int:
        """Prompt tokens its next read takes from: the drafter's part of a cached prefix, else the target's rest."""
        if self.drafter_read < self.read:
            return self.read - self.drafter_read
        return max(0, len(self.prompt) - 1 - self.read)

    @property
    def read_all_but_last(self) -> bool:
        """Every prompt token but the last is in the caches, the drafter's too: the row can take its first token."""
        return self.read >= len(self.prompt) - 1 and self.drafter_read >= self.read


def _under_grammar(row: SpecRow, logits: mx.array) -> mx.array:
    return logits if row.grammar is None else row.grammar.mask(logits)


def _picked(row: SpecRow, logits: mx.array, tokens: mx.array) -> tuple | None:
    """Lazy logprobs of `tokens` at the positions of `logits` (raw: before the row's grammar or sampling)."""
    if row.logprobs is None:
        return None
    return pick(log_softmax(logits), tokens, row.logprobs.top, row.logprobs.limit)


def _arrays(scored: list) -> list:
    return [a for picked in scored if picked is not None for a in picked if a is not None]


def _emitted_logprobs(row: SpecRow, picked: tuple | None, tokens: list[int]) -> None:
    if picked is not None:
        n = len(tokens)
        row.emitted_logprobs = read(tokens, tuple(a[:n] if a is not None else None for a in picked),
                                    row.logprobs.texts)


def _entries(rows: list[SpecRow], hidden: mx.array | None) -> list:
    """Lazy top entries [B, L, K] of a forward's hidden states, when a row commits (and the model has them)."""
    if hidden is None or not any(r.commit for r in rows):
        return []
    return list(top_entries(hidden))


def _emitted_entries(row: SpecRow, entries: list, i: int, n: int) -> None:
    """Row i's entries of its first n positions (the tokens it emits), read back."""
    if row.commit and entries:
        row.emitted_entries = tuple(np.array(a[i, :n]) for a in entries)


def rollback(caches: list, n: int) -> None:
    """Drop the last `n` positions from every cache, sliding-window (rotating) caches included."""
    if n <= 0:
        return
    for c in caches:
        if isinstance(c, ArraysCache):
            continue  # a recurrent layer's state: rewound by the round (recurrent.Rewind), it has no trim
        c.trim(n)  # KVCache and RotatingKVCache both move offset back; is_trimmable() is too strict here
        if isinstance(c, RotatingKVCache) and c.keys is not None:
            # A verify step leaves the buffer in temporal order; cut the stale tail now, or the next
            # width-1 update trims live entries from the front and writes over the wrong slot.
            c.keys, c.values = (tuple(a[..., : c._idx, :] for a in x) if isinstance(x, tuple)  # quantized: a triple
                                else x[..., : c._idx, :] for x in (c.keys, c.values))


def merged(rows_caches: list[list]) -> list:
    """Per-layer batch caches of several rows (left-padded to the longest); one row's own caches as they are. Each
    kind merges into its batch kind (KVCache: BatchKVCache, RotatingKVCache: BatchRotatingKVCache,
    QuantizedKVRow: BatchQuantizedKVCache), as mlx-lm's generator merges them."""
    if len(rows_caches) == 1:
        return rows_caches[0]
    return [layer[0].merge(list(layer)) for layer in zip(*rows_caches)]


def split(caches: list, rows: int) -> list[list]:
    """Each row's own caches back out of merged ones."""
    if rows == 1:
        return [caches]
    return [[c.extract(i) for c in caches] for i in range(rows)]


def prefill(model, cache: list, tokens: list[int], step: int) -> None:
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i:i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


class Speculator:
    """One loaded pair's round loop over any set of rows."""

    def __init__(self, model, drafter, new_caches=None):
        self.target = Target(model)
        self.model = model
        self.drafter = drafter
        recurrent.install(model)  # a hybrid target's recurrent layers record what a verify feeds them
        # A new row's fresh caches: the model's KV precision (kv_quant.caches_for); mlx-lm's by default
        self._new_caches = new_caches or (lambda: make_prompt_cache(model))

    def new_row(self, prompt: list[int], *, stats: SpecTelemetry, choice=None, caches: list | None = None,
                cached: int = 0, grammar=None, logprobs=None, commit: bool = False) -> SpecRow:
        """A row for `prompt`; `caches` may already hold the K/V of its first `cached` tokens."""
        choice = choice or GreedyChoice()
        stats.sampling_scheme = choice.scheme
        row = SpecRow(list(prompt), choice, stats, caches if caches is not None else self._new_caches(),
                      grammar=grammar, logprobs=logprobs, commit=commit)
        row.read = cached
        row.tokens = list(prompt[:cached])
        self.drafter.begin(row)  # a cached prefix the drafter reads as the prompt is read, a chunk per step
        return row

    def read(self, row: SpecRow, step: int) -> bool:
        """Read up to `step` more prompt tokens, all but the last, by the one prompt reader (prompt_reader): first
        what the drafter has not read of a cached prefix, then the rest of the prompt, the drafter reading each
        chunk after the target; True once they are all in the caches."""
        if row.drafter_read < row.read:
            self._drafter_reads(row, step)
            return row.read_all_but_last
        def forward(start: int, end: int) -> None:
            self.model(mx.array(row.prompt[start:end])[None], cache=row.caches)

        start, end = PromptReader(row.prompt, row.caches, forward, read=row.read).step(step)
        if end > start:
            row.read = end
            row.tokens += row.prompt[start:end]
            self._drafter_reads(row, step)
        return row.read_all_but_last

    def _drafter_reads(self, row: SpecRow, step: int) -> None:
        chunk = row.prompt[row.drafter_read:row.read][:step]
        if chunk:
            self.drafter.read(row, chunk)
            row.drafter_read += len(chunk)

    def begin(self, rows: list[SpecRow]) -> list[int]:
        """The first token of each row whose prompt is read but its last token: that token, width 1 as
        mlx-lm's plain path reads it, in one forward over the rows."""
        for r in rows:  # rows begun directly (not read step by step): the drafter reads their cached prefix now
            self._drafter_reads(r, r.read)
        caches = merged([r.caches for r in rows])
        logits, hidden = self.target.forward(mx.array([[r.prompt[-1]] for r in rows]), caches)
        for r in rows:
            r.choice.at(r.position)
        firsts = [r.choice.first(_under_grammar(r, logits[i:i + 1, -1, :])) for i, r in enumerate(rows)]
        scored = [_picked(r, logits[i:i + 1, -1, :], first) for i, (r, first) in enumerate(zip(rows, firsts))]
        entries = _entries(rows, hidden)
        mx.eval(firsts, hidden if hidden is not None else [], _arrays(scored), entries)
        for i, (row, own, first) in enumerate(zip(rows, split(caches, len(rows)), firsts)):
            _emitted_logprobs(row, scored[i], [first.item()])
            _emitted_entries(row, entries, i, 1)
            row.caches = own
            row.last, row.read = first.item(), len(row.prompt)
            if row.grammar is not None:
                row.grammar.consume([row.last])
            row.drafter_read = row.read  # the last prompt token is the drafter's pending input (start)
            row.tokens.append(row.prompt[-1])
            row.hidden = hidden[i:i + 1, -1:, :] if hidden is not None else None
            row.stats.target_forwards += 1
            row.stats.emitted += 1
            self.drafter.start(row, row.last)
        return [row.last for row in rows]

    def round(self, rows: list[SpecRow]) -> list[list[int]]:
        """One round over rows that share a k: each row's new tokens (its accepted drafts, then one more)."""
        k = rows[0].k
        assert all(r.k == k for r in rows), "a round's rows share one k"
        t0 = time.perf_counter()
        caches = merged([r.caches for r in rows])
        for r in rows:
            r.choice.at(r.position)
        drafts, qs = self.drafter.propose(rows, k, caches)
        mx.eval(drafts, qs)  # materialized here so the draft views into the caches are released before verify
        t1 = time.perf_counter()
        last = mx.array([[r.last] for r in rows])
        rewind = recurrent.begin(self.model, caches)
        logits, hidden_all = self.target.forward(mx.concatenate([last, drafts], axis=1), caches)
        if rewind is not None:
            rewind.done()
        # A constrained row's k+1 positions under the masks its drafts were drawn with, and the bonus's.
        verdicts = [r.choice.verify(logits[i] if r.grammar is None else masked(logits[i], r.grammar.verify_masks()),
                                    drafts[i], qs[i]) for i, r in enumerate(rows)]
        steered = [mx.concatenate(r.grammar.steered).sum() if r.grammar is not None and r.grammar.steered
                   else mx.array(0) for r in rows]
        # The target's own logprobs of what each row emits: its accepted drafts, then the token after them.
        scored = [_picked(r, logits[i], mx.where(mx.arange(k + 1) == n, after, mx.concatenate([drafts[i], after])))
                  for i, (r, (n, after, _)) in enumerate(zip(rows, verdicts))]
        entries = _entries(rows, hidden_all)
        mx.eval(verdicts, steered, _arrays(scored), entries)  # the round's one read-back
        t2 = time.perf_counter()
        out = []
        drafted = drafts.tolist()
        for i, (row, own, (accepted, after, extras)) in enumerate(zip(rows, split(caches, len(rows)), verdicts)):
            n, bonus = accepted.item(), after.item()
            _emitted_logprobs(row, scored[i], [*drafted[i][:n], bonus])
            _emitted_entries(row, entries, i, n + 1)
            rollback(own, k - n)
            if rewind is not None:
                rewind.row(own, i, n + 1, k + 1)
            row.caches = own
            row.tokens += [row.last, *drafted[i][:n]]
            row.last = bonus
            row.hidden = hidden_all[i:i + 1, n:n + 1, :] if hidden_all is not None else None
            self.drafter.accepted(row, n, k, drafted[i], bonus)
            self._count(row.stats, n, k, len(rows), extras, t1 - t0, t2 - t1)
            if row.grammar is not None:
                row.grammar.settle([*drafted[i][:n], bonus])
                row.grammar.steered = []
                row.stats.grammar_steered += steered[i].item()
            out.append([*drafted[i][:n], bonus])
        return out

    @staticmethod
    def _count(stats: SpecTelemetry, n: int, k: int, rows: int, extras: dict, draft_s: float, verify_s: float) -> None:
        judged = min(n + 1, k)  # the drafts judged this round: up to and including the first rejection
        stats.judged += judged
        if extras:
            stats.min_overlap += sum(extras["min_overlap"].tolist()[:judged])
            stats.dot_overlap += sum(extras["dot_overlap"].tolist()[:judged])
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += n
        stats.target_forwards += 1
        stats.emitted += n + 1
        stats.batch_rows += rows
        stats.draft_s += draft_s
        stats.verify_s += verify_s


def speculative_tokens(model, prompt: list[int], drafter, *, k: int, stats: SpecTelemetry,
                       prefill_step: int = 2048, choice=None, new_caches=None) -> Iterator[int]:
    """Tokens for `prompt` alone, k drafts verified per target forward: identical to plain greedy decoding,
    or distributed exactly as plain sampling, as `choice` says (greedy when None)."""
    spec = Speculator(model, drafter, new_caches)
    row = spec.new_row(prompt, stats=stats, choice=choice)
    while not spec.read(row, prefill_step):
        pass
    yield spec.begin([row])[0]
    while True:
        yield from spec.round([row])[0]
