"""DSpark's low-rank Markov correction (checkpoints: drafters.dflash.dspark), as mlx-vlm's VanillaMarkov computes it: block
position i's logits are base_i + markov_w2(markov_w1[previous token]). The previous token of the first position is
the anchor (the row's last committed token), of each later one the draft drawn just before it; so a round draws its
drafts one position after another, each from the corrected logits given the one before (engine.dflash_drafter)."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn


class MarkovCorrection(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def __call__(self, base: mx.array, previous: mx.array) -> mx.array:
        """base [B, V] logits of one block position, previous [B] tokens -> the corrected logits [B, V]."""
        return base + self.markov_w2(self.markov_w1(previous))
