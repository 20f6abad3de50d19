"""Drafters: what proposes a round's k tokens for each row (provider.engine.spec_rounds runs the round).

- DraftModelDrafter: a smaller LM with the target's vocabulary; each row has its own caches of it.
- MTPDrafter: the Gemma 4 assistant, which reads the target's own committed K/V and last hidden state.

Both draft every row of a round together, each row drawing from its own logits by its own choice (greedy
or sampled, with its own key), and return each row's draft distributions for the verify step.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..models.gemma4_assistant import QUERY_POSITION_OFFSET, Gemma4Assistant
from ..types import SpecMode
from .spec_rounds import SpecRow, merged, rollback, split
from ..models.gemma4_target import Target


def _draw(rows: list[SpecRow], logits: mx.array, qs: list[list]) -> mx.array:
    """Each row's draft from its own logits [B, V], by its own choice; returns the drafts [B, 1]. A constrained
    row drafts under its grammar's mask, and the grammar takes the draft at once (the next mask depends on it):
    its draft is read back here, one sync per draft position."""
    tokens = []
    for i, row in enumerate(rows):
        own = logits[i:i + 1]
        token, q = row.choice.draft(own if row.grammar is None else row.grammar.draft(own))
        if row.grammar is not None:
            row.grammar.drafted(token.item())
        tokens.append(token)
        qs[i].append(q)
    return mx.concatenate(tokens)[:, None]


class DraftModelDrafter:
    """A smaller LM with the target's vocabulary; each row has its own caches of it, merged per round.

    A row's draft caches hold every committed token but the two pending ones, the token before `last` and
    `last`, so each round's first draft step has the same width (2) on every row."""

    mode = "draft"

    def __init__(self, model):
        self.model = model

    def begin(self, row: SpecRow) -> None:
        row.draft = {"cache": make_prompt_cache(self.model), "pending": []}

    def read(self, row: SpecRow, tokens: list[int]) -> None:
        """Prompt tokens, as the target reads them; the last prompt token stays pending."""
        for i in range(0, len(tokens), 512):
            self.model(mx.array(tokens[i:i + 512])[None], cache=row.draft["cache"])
            mx.eval([c.state for c in row.draft["cache"]])

    def start(self, row: SpecRow, first: int) -> None:
        row.draft["pending"] = [row.prompt[-1], first]

    def propose(self, rows: list[SpecRow], k: int, caches: list) -> tuple[mx.array, list[list]]:
        batch = merged([r.draft["cache"] for r in rows])
        x, drafted, qs = mx.array([r.draft["pending"] for r in rows]), [], [[] for _ in rows]
        for _ in range(k):
            x = _draw(rows, self.model(x, cache=batch)[:, -1, :], qs)
            drafted.append(x)
        for row, own in zip(rows, split(batch, len(rows))):
            row.draft["cache"] = own
        return mx.concatenate(drafted, axis=1), qs

    def accepted(self, row: SpecRow, n: int, k: int, drafts: list[int], bonus: int) -> None:
        # The caches took both pending tokens and drafts d1..d(k-1); keep all but the new pending pair.
        rollback(row.draft["cache"], k - n)
        row.draft["pending"] = [drafts[n - 1] if n else row.draft["pending"][-1], bonus]


class MTPDrafter:
    """The Gemma 4 assistant: reads the target's committed K/V and last hidden state; no state of its own."""

    mode = "mtp"

    def __init__(self, assistant: Gemma4Assistant, target: Target):
        self.assistant = assistant
        self.target = target

    def begin(self, row: SpecRow) -> None:
        pass

    def read(self, row: SpecRow, tokens: list[int]) -> None:
        pass

    def start(self, row: SpecRow, first: int) -> None:
        pass

    def propose(self, rows: list[SpecRow], k: int, caches: list) -> tuple[mx.array, list[list]]:
        kv, masks = self.target.shared_kv(caches)
        # The query position is held for the whole round, per row.
        position = (rows[0].committed + QUERY_POSITION_OFFSET if len(rows) == 1
                    else mx.array([r.committed + QUERY_POSITION_OFFSET for r in rows]))
        token = mx.array([[r.last] for r in rows])
        h = mx.concatenate([r.hidden for r in rows], axis=0)
        drafted, qs = [], [[] for _ in rows]
        for _ in range(k):
            logits, h = self.assistant.step(self.target.scaled_embedding(token), h, kv, position, masks)
            token = _draw(rows, logits[:, -1, :], qs)
            drafted.append(token)
        return mx.concatenate(drafted, axis=1), qs

    def accepted(self, row: SpecRow, n: int, k: int, drafts: list[int], bonus: int) -> None:
        pass


def drafter_for(lm):
    """The drafter of a loaded pair (`models.loader.LoadedModel`); per-row state lives on the rows."""
    if lm.drafter_mode == SpecMode.MTP:
        return MTPDrafter(lm.drafter, Target(lm.model))
    return DraftModelDrafter(lm.drafter)
