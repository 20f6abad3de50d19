"""A DFlash drafter (drafters.dflash.head) in the node's round loop (spec_rounds.Speculator).

Each row has the drafter's context cache of its own (the K/V of every committed position's tapped target features)
and `pending`, the features of positions committed since its last round. A round, per row: the pending features
into the cache, then one forward of the block [last, mask x k] at the positions after the context, whose block
positions 1..k give the k draft distributions at once; each row then draws its drafts position by position, under
its grammar (the mask of position j follows the drafts before it; the logits do not, but for a DSpark drafter's
Markov correction by the draft before each, drafters.dflash.dspark_head, and for a DFlash2 drafter's candidate selector,
which scores the top-k by the draft before each, drafters.dflash.dflash2_head). After the verify, the tapped
outputs of the row's `last` and accepted drafts become its pending features: the cache held the context only, so
nothing is rolled back.

The rows' blocks run in one forward, their contexts (of different lengths) left-padded and masked (mlx-vlm's
batched DFlash loop drafts rowwise instead). A prompt prefix served from the prefix cache left no features: the
drafter's positions skip it (lossless; it only drafts less well).
"""

from __future__ import annotations

import mlx.core as mx

from ..drafters.dflash.head import DFlashHead
from ..models.gemma4_target import Target
from .acceptance import draw_drafts
from .spec_rounds import SpecRow


class DFlashDrafter:
    mode = "mtp"

    def __init__(self, head: DFlashHead, target: Target):
        self.head, self.target = head, target
        self.embed, self.lm_head = head.embedding(target.lm)  # the target's, or a Gemma 4 DSpark drafter's own
        self._index: dict[int, int] = {}  # each row's index in the round's verify, by identity (HeadDrafter's)

    def begin(self, row: SpecRow) -> None:
        row.draft = {"cache": self.head.make_cache(), "pending": None, "skip": 0, "unseen": row.read}

    def _position(self, row: SpecRow) -> int:
        return row.draft["skip"] + row.draft["cache"][0].offset

    def read(self, row: SpecRow, tokens: list[int]) -> None:
        """A chunk of prompt the target has just read (its tapped features are the tap's latest), or of a cached
        prefix (none: its positions are skipped)."""
        d = row.draft
        if d["unseen"] > 0:
            d["unseen"] -= len(tokens)
            d["skip"] += len(tokens)
            return
        features = self.head.tap.last
        assert features is not None and features.shape[1] == len(tokens), "the drafter reads the chunk the target read"
        self.head.context(features, d["cache"], self._position(row))
        mx.eval([c.state for c in d["cache"]])

    def start(self, row: SpecRow, first: int) -> None:
        # Speculator.begin starts its rows in the order of its one forward's batch, right after it.
        row.draft["pending"] = self.head.tap.next_row()

    def propose(self, rows: list[SpecRow], k: int, caches: list) -> tuple[mx.array, list[list]]:
        self._index = {id(r): i for i, r in enumerate(rows)}
        for row in rows:
            d = row.draft
            if d["pending"] is not None:
                self.head.context(d["pending"], d["cache"], self._position(row))
                d["pending"] = None
        h = self.head.block_rows(self.embed(mx.array([self.head.block_tokens(r.last, k) for r in rows])),
                                 [r.draft["cache"] for r in rows], [self._position(r) for r in rows])
        logits = self.head.draft_logits(h, self.lm_head)  # [B, k, V]
        markov, previous = self.head.markov_head, mx.array([r.last for r in rows])
        selecting = getattr(self.head, "selecting", None)  # DFlash2's candidate selector
        drafted, qs = [], [[] for _ in rows]
        for j in range(k):
            # DSpark: position j's logits corrected by the token before it (the anchor, then each row's own draft);
            # DFlash2: its candidates scored given that token. So q_j is exactly the distribution d_j is drawn from.
            drafted.append(draw_drafts(rows, logits[:, j, :] if markov is None else markov(logits[:, j, :], previous),
                                       qs, selecting and selecting(h, j, previous)))
            previous = drafted[-1][:, 0]
        return mx.concatenate(drafted, axis=1), qs

    def accepted(self, row: SpecRow, n: int, k: int, drafts: list[int], bonus: int) -> None:
        # The verify's tapped outputs [rows, k + 1, n * H] are the tap's latest: no other forward of the target
        # runs between the verify and this. The row's last and its n accepted drafts are committed.
        i = self._index[id(row)]
        row.draft["pending"] = self.head.tap.last[i:i + 1, :n + 1]
