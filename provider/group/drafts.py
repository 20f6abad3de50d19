"""Speculation in a node group: rank 0 drafts, every rank verifies.

The drafter (a native MTP head or a draft model) lives on rank 0 alone: it reads only the tokens and the target's
final hidden state, which rank 0 holds whole however the model is split. In each round rank 0 drafts, then sends
the drafts (`LeaderDrafts`); every other rank takes them in place of a drafter (`FollowerDrafts`), and all run the
same verify forward, whose collectives meet as a plain step's do. Each rank then judges the drafts itself: a
greedy row by the target's argmax, a sampled row by the coupled draw of its seed (rank 0 seeds every sampled row
of a group), neither of which needs the drafter's distribution. So every rank keeps the same tokens, and the
step's check (lockstep.check_step) compares them as it compares a plain step's.
"""

from __future__ import annotations

import mlx.core as mx

from ..engine.collective import GroupLost
from .link import Link

KIND = "drafts"


class LeaderDrafts:
    """Rank 0's drafter: its own pair's, each round's drafts shared with the other ranks before the verify."""

    def __init__(self, inner, link: Link, tap):
        self.inner, self.link, self.tap = inner, link, tap
        self.mode = inner.mode

    def __getattr__(self, name):  # begin, start, accepted: the pair's own drafter's
        return getattr(self.inner, name)

    def read(self, row, tokens: list[int]) -> None:
        settle_hidden(self.tap)
        self.inner.read(row, tokens)

    def propose(self, rows: list, k: int, caches: list) -> tuple[mx.array, list[list]]:
        drafts, qs = self.inner.propose(rows, k, caches)
        self.link.share(KIND, {"k": k, "drafts": drafts.tolist()})
        return drafts, qs


class FollowerDrafts:
    """Another rank's drafter: no model, rank 0's drafts for each round, checked against this rank's round."""

    mode = "group"

    def __init__(self, link: Link, vocab_size: int, tap):
        self.link, self.vocab_size, self.tap = link, vocab_size, tap

    def begin(self, row) -> None:
        row.draft = None

    def read(self, row, tokens: list[int]) -> None:
        settle_hidden(self.tap)

    def start(self, row, first: int) -> None:
        pass

    def accepted(self, row, n: int, k: int, drafts: list[int], bonus: int) -> None:
        pass

    def propose(self, rows: list, k: int, caches: list) -> tuple[mx.array, list[list]]:
        drafted = drafts_of(self.link.share(KIND), len(rows), k, self.vocab_size)
        for row, tokens in zip(rows, drafted):
            if row.grammar is not None:  # the masks rank 0 drafted under, for the verify: the same grammar steps
                for token in tokens:
                    row.grammar.draft(mx.zeros((1, self.vocab_size)))
                    row.grammar.drafted(token)
        return mx.array(drafted, dtype=mx.int32), [[None] * k for _ in rows]


def settle_hidden(tap) -> None:
    """Evaluate the final hidden state of the prompt chunk just read, on every rank at this same point. A chunk's
    read evaluates only its caches, which the last layer's output feeds none of; that output's collectives (a
    split layer's all-sums) run when something reads it, and a head on rank 0 reads it. Run there alone, they
    would meet the other ranks' next collective instead and the group would hang."""
    if tap is not None and tap.last is not None:
        mx.eval(tap.last)


def drafts_of(body: dict, rows: int, k: int, vocab_size: int) -> list[list[int]]:
    """Rank 0's drafts for a round of `rows` rows and `k` drafts each, every id below `vocab_size` (the verify
    embeds them: an id past the table is read out of bounds by native code); else GroupLost."""
    drafts = body.get("drafts") if isinstance(body, dict) and set(body) == {"k", "drafts"} else None
    if type(body.get("k") if drafts is not None else None) is not int or body["k"] != k \
            or not isinstance(drafts, list) or len(drafts) != rows \
            or not all(isinstance(d, list) and len(d) == k and all(type(t) is int and 0 <= t < vocab_size for t in d)
                       for d in drafts):
        raise GroupLost(f"rank 0's drafts do not fit this rank's round ({rows} rows of {k} drafts below "
                        f"{vocab_size}): the ranks disagree on what runs; the group stops")
    return drafts
