"""Fixture factory: `qwen3-dspark-tiny`, fixtures' tiny Qwen3 target and a DSpark drafter (models.dspark) for it
in the layout mlx-vlm's DSparkDraftModel loads, written beside the target at fixtures_dflash.drafter_dir(target).

The drafter is fixtures_dflash's (the same config, both target layers tapped) with `architectures:
[DSparkDraftModel]`, `block_size` 7 (proposals: the block is the anchor and 6 masks, the anchor's position drafting
the first token) and dflash_config {projector_type: dspark, markov_rank 16, enable_confidence_head}; its tensors
add `markov_head.markov_w1` [V, 16], `markov_head.markov_w2` [V, 16] and an (untrained) `confidence_head.proj`.
It is distilled as the DFlash fixture, each block position's logits corrected by the true previous token (what the
draft before it is when accepted), so that drafts on the training prompts are often accepted.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .fixtures import make_qwen3_tiny
from .fixtures_dflash import BLOCK, _Context, build_beside, drafter_config

RANK = 16


def dspark_config(target_config: dict) -> dict:
    config = drafter_config(target_config)
    return config | {"architectures": ["DSparkDraftModel"], "block_size": BLOCK - 1,
                     "dflash_config": config["dflash_config"] | {"projector_type": "dspark", "markov_rank": RANK,
                                                                 "enable_confidence_head": True}}


def make_qwen3_dspark_tiny(out: Path, seed: int = 29, train: bool = True, steps: int = 80) -> None:
    """The target at `out`, its drafter at `drafter_dir(out)`, with an untrained confidence head (read and ignored by
    the node)."""
    from .dflash_head import DFlashHead

    def saved(weights: dict) -> dict:
        h = weights["fc.weight"].shape[0]
        return weights | {"confidence_head.proj.weight": 0.02 * mx.random.normal((1, h + RANK)),
                          "confidence_head.proj.bias": mx.zeros(1)}

    build_beside(out, make_qwen3_tiny, dspark_config, DFlashHead, seed, train, steps, logits_fn=block_logits,
                 saved=saved)


def block_logits(head, embed, lm_head, features: mx.array, seqs: mx.array, anchor: int, k: int) -> mx.array:
    """The drafter's corrected logits [N, k, V] for the block anchored at `anchor`, each position's previous token
    the true one (seqs[:, anchor + i]): what it drafts for seqs[:, anchor + 1 : anchor + 1 + k]."""
    cache = [_Context() for _ in head.layers]
    head.context(features[:, :anchor], cache, 0)
    masks = mx.full((seqs.shape[0], k - head.from_anchor), head.mask_token_id, dtype=seqs.dtype)
    block = mx.concatenate([seqs[:, anchor:anchor + 1], masks], axis=1)
    base = head.draft_logits(head.block(embed(block), cache, anchor), lm_head)
    return head.markov_head(base, seqs[:, anchor:anchor + k])
