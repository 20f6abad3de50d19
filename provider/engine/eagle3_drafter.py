"""An EAGLE-3 drafter (models.eagle3_head) in the round loop: HeadDrafter's rounds, fed the target's tapped layers.

The pairs and the rounds are HeadDrafter's: (token t+1, hidden at t) at position t, the drafter's own KV cache per
row, the k - 1 draft pairs dropped after each verify and the accepted drafts and bonus read back with the target's
own hidden states, a prefix served from the prefix cache read from where the target's forwards start. What
differs: the hidden is the concatenation of three of the target's decoder layers' outputs (the layer tap the
drafter's load installed: verification.hidden_tap.LayerTap), not its final-norm hidden; and the drafter's logits
cover its draft vocabulary only, scattered onto the target's through d2t (ids outside it: probability 0), so the
draft distribution q of a sampled round is over the target's vocabulary, as the verify needs.
"""

from __future__ import annotations

import mlx.core as mx

from ..models.eagle3_head import Eagle3Head
from ..models.gemma4_target import Target
from .drafters import HeadDrafter
from .spec_rounds import SpecRow


class Eagle3Drafter(HeadDrafter):
    def __init__(self, head: Eagle3Head, target: Target):
        self.head, self.target = head, target
        lm = target.lm
        self.embed = head.embed_tokens if "embed_tokens" in head else lm.model.embed_tokens
        self.width = lm.model.embed_tokens.weight.shape[0]  # the target's vocabulary, as its logits score it
        head_out = getattr(lm, "lm_head", None)
        if head_out is not None and hasattr(head_out, "weight"):
            self.width = head_out.weight.shape[0]
        self.lm_head = None
        self._index: dict[int, int] = {}

    def _latest(self) -> mx.array:
        return self.head.tap.last

    def _start_hidden(self, row: SpecRow) -> mx.array:
        # Speculator.begin starts its rows in the order of its one forward's batch, right after it.
        return self.head.tap.next_row()

    def _logits(self, h: mx.array) -> mx.array:
        return self.head.target_logits(h, self.width)
