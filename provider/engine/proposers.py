"""The engine's proposers: what proposes a round's k tokens for each row (provider.engine.spec_rounds runs the
round), one proposer per method, which each drafter kind names (provider.drafters.registry; PROPOSERS below).

- DraftModelDrafter: a smaller LM with the target's vocabulary; each row has its own caches of it.
- MTPDrafter: the Gemma 4 assistant, which reads the target's own committed K/V and last hidden state.
- HeadDrafter: an MTP head shipped inside the target's checkpoint (drafters.mtp.heads), with a KV cache of its own
  per row, fed the target's final-norm hidden states. An EAGLE-3 drafter runs the same rounds (Eagle3Drafter).

Both draft every row of a round together, each row drawing from its own logits by its own choice (greedy
or sampled, with its own key), and return each row's draft distributions for the verify step.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..drafters import registry
from ..drafters.gemma4_assistant import QUERY_POSITION_OFFSET, Gemma4Assistant
from ..models.gemma4_target import Target
from .acceptance import draw_drafts
from .spec_rounds import SpecRow, merged, rollback, split


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
            x = draw_drafts(rows, self.model(x, cache=batch)[:, -1, :], qs)
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
            token = draw_drafts(rows, logits[:, -1, :], qs)
            drafted.append(token)
        return mx.concatenate(drafted, axis=1), qs

    def accepted(self, row: SpecRow, n: int, k: int, drafts: list[int], bonus: int) -> None:
        pass


class HeadDrafter:
    """A native MTP head (drafters.mtp.heads): the pair (token t+1, target hidden at t) at position t, its own K/V.

    A row's head cache holds every pair the head has read for good; `pending` the pairs it reads at the start of
    the next round, ending with (last, the hidden that produced last). A round reads them all in its first step
    (rows of other widths right-padded, the padding then rolled into the left padding, as mlx-lm's batch caches
    do for ragged prompts), then drafts k - 1 more from its own hidden; after the verify the k - 1 draft pairs
    are dropped and the accepted drafts come back as pending with the target's own hidden states (as vLLM replays
    them: mlx-vlm keeps the head's own, which agrees less). A prompt prefix served from the prefix cache left no
    hidden states: the head reads from where the target's forwards start (lossless; it only drafts less well)."""

    mode = "mtp"

    def __init__(self, head, target: Target):
        self.head, self.target = head, target
        lm = target.lm
        own = getattr(head, "embed_tokens", None)  # a head that ships its own embedding (GLM's nextn layer) uses it
        self.embed = lm.model.embed_tokens if own is None else own
        self.lm_head = head.lm_head or getattr(lm, "lm_head", None) or self.embed.as_linear
        # Each row's index in the current round's verify, by identity: the rows themselves are not held, or the
        # last round's rows (their caches, the target's and the head's) outlived their jobs until the next round.
        self._index: dict[int, int] = {}

    def begin(self, row: SpecRow) -> None:
        row.draft = {"cache": self.head.make_cache(), "pending": [], "carry": None, "unseen": row.read}

    def read(self, row: SpecRow, tokens: list[int]) -> None:
        """A chunk of prompt the target has just read (its hidden states are the tap's latest), or of a cached
        prefix (none: skipped)."""
        d = row.draft
        if d["unseen"] > 0:
            d["unseen"] -= len(tokens)
            return
        hidden = self._latest()
        assert hidden is not None and hidden.shape[1] == len(tokens), "the head reads the chunk the target read"
        pairs = ([(tokens[0], d["carry"])] if d["carry"] is not None else []) + \
            [(t, hidden[:, j:j + 1]) for j, t in enumerate(tokens[1:])]
        d["carry"] = hidden[:, -1:]
        if pairs:
            self.head(self.embed(mx.array([[t for t, _ in pairs]])), mx.concatenate([h for _, h in pairs], axis=1),
                      d["cache"])
            mx.eval([c.state for c in d["cache"]])

    def start(self, row: SpecRow, first: int) -> None:
        d = row.draft
        d["pending"] = ([(row.prompt[-1], d["carry"])] if d["carry"] is not None else []) + \
            [(first, self._start_hidden(row))]
        d["carry"] = None

    def propose(self, rows: list[SpecRow], k: int, caches: list) -> tuple[mx.array, list[list]]:
        self._index = {id(r): i for i, r in enumerate(rows)}
        widths = [len(r.draft["pending"]) for r in rows]
        width = max(widths)
        cache = merged([r.draft["cache"] for r in rows])
        if len(rows) > 1 and min(widths) < width:
            for c in cache:
                c.prepare(right_padding=[width - w for w in widths])
        pad = [(0, mx.zeros_like(rows[0].draft["pending"][-1][1]))]
        pending = [r.draft["pending"] + pad * (width - w) for r, w in zip(rows, widths)]
        tokens = mx.array([[t for t, _ in p] for p in pending])
        h = self.head(self.embed(tokens), mx.concatenate([mx.concatenate([h for _, h in p], axis=1) for p in pending]),
                      cache)
        if len(rows) > 1:
            for c in cache:
                c.finalize()  # the right padding becomes left padding (nothing to do when none was added)
        h = mx.take_along_axis(h, mx.array(widths)[:, None, None] - 1, axis=1)  # each row's last real pair
        drafted, qs = [], [[] for _ in rows]
        for step in range(k):
            token = draw_drafts(rows, self._logits(h)[:, -1, :], qs)
            drafted.append(token)
            if step < k - 1:
                h = self.head(self.embed(token), h, cache)
        for row, own in zip(rows, split(cache, len(rows))):
            row.draft["cache"] = own
        return mx.concatenate(drafted, axis=1), qs

    def accepted(self, row: SpecRow, n: int, k: int, drafts: list[int], bonus: int) -> None:
        # The verify's final-norm hidden states [rows, k + 1, H] are the tap's latest: the round runs no other
        # forward of the target between its verify and this.
        verified = self._latest()
        i = self._index[id(row)]
        rollback(row.draft["cache"], k - 1)  # the head's own draft pairs
        tokens = [*drafts[:n], bonus]
        row.draft["pending"] = [(t, verified[i:i + 1, j:j + 1]) for j, t in enumerate(tokens)]

    def _latest(self) -> mx.array:
        """The hidden states the head reads of the target's latest forward on this thread [B, L, H]: the final
        norm's output, or what the head's own tap records (Step-3.5's: that norm's input)."""
        return (self.head.tap or self.target.tap).last

    def _start_hidden(self, row: SpecRow) -> mx.array:
        """Of the row's first token's forward (Speculator.begin), the hidden that produced it [1, 1, H]."""
        if self.head.tap is None:
            return row.hidden
        return self.head.tap.next_row()[:, None]  # begin starts its rows in its forward's batch order, right after it

    def _logits(self, h: mx.array) -> mx.array:
        """The head's hidden [B, L, H] -> draft logits over the target's vocabulary [B, L, V]."""
        return self.lm_head(self.head.readout(h))


class Eagle3Drafter(HeadDrafter):
    """An EAGLE-3 drafter (drafters.eagle3.head): HeadDrafter's rounds, pairs and rollback, fed the concatenated outputs
    of three of the target's decoder layers (the layer tap its load installed: proofs.hidden_tap.LayerTap)
    instead of the final-norm hidden, and its draft-vocabulary logits scattered onto the target's vocabulary
    through d2t (ids outside it: probability 0), so a sampled round's q is over the target's vocabulary."""

    def __init__(self, head, target: Target):
        self.head, self.target = head, target
        embed = target.lm.model.embed_tokens
        self.embed = head.embed_tokens if "embed_tokens" in head else embed  # the target's unless it ships one
        self.width = embed.weight.shape[0]  # the target's vocabulary, as its logits score it
        self._index: dict[int, int] = {}

    def _latest(self) -> mx.array:
        return self.head.tap.last

    def _start_hidden(self, row: SpecRow) -> mx.array:
        # Speculator.begin starts its rows in the order of its one forward's batch, right after it.
        return self.head.tap.next_row()

    def _logits(self, h: mx.array) -> mx.array:
        return self.head.target_logits(h, self.width)


def _dflash(lm):
    from .dflash_drafter import DFlashDrafter  # its rounds' code, imported with the first DFlash pair

    return DFlashDrafter(lm.drafter, Target(lm.model))


# The proposers that run a round for each drafter kind (drafters.registry), by the name a kind gives as its
# `proposer`: several kinds may share one (a native head's rounds serve any head fed the target's hidden states).
PROPOSERS = {
    "draft": lambda lm: DraftModelDrafter(lm.drafter),
    "assistant": lambda lm: MTPDrafter(lm.drafter, Target(lm.model)),
    "head": lambda lm: HeadDrafter(lm.drafter, Target(lm.model)),
    "eagle3": lambda lm: Eagle3Drafter(lm.drafter, Target(lm.model)),
    "dflash": _dflash,
}


def drafter_for(lm):
    """The drafter of a loaded pair (`models.loader.LoadedModel`): its kind's proposer; per-row state lives on the
    rows."""
    return PROPOSERS[registry.named(lm.drafter_kind).proposer](lm)
