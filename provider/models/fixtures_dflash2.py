"""Fixture factory: `qwen3-dflash2-tiny`, fixtures' tiny Qwen3 target and a DFlash2 drafter (models.dflash2) for it
in the layout mlx-vlm's DFlash2DraftModel loads, written beside the target at fixtures_dflash.drafter_dir(target).

The drafter is fixtures_dflash's (the same config, both target layers tapped, block 8) with `architectures:
[DFlash2DraftModel]` and dflash_config's DFlash2 keys: convolutions of kernel 3 over groups of 16 channels,
a selector of rank 16 over the top 32 candidates, and an input embedding scale, output multiplier and final softcap
other than 1 / none (so a comparison with mlx-vlm sees them applied). Its codebooks are stored without `.weight`, as
mlx-vlm's sanitize expects them. It is distilled as the DFlash fixture, on its base logits and every token's score as a
candidate given the true previous token (what the draft before it is when accepted), so drafts on the training
prompts are often accepted.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn

from .fixtures import make_qwen3_tiny
from .fixtures_dflash import _Context, build_beside, drafter_config

SELECTOR = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 32,
            "input_embedding_scale": 1.5, "output_multiplier": 0.75, "final_logit_softcapping": 30.0}


def dflash2_config(target_config: dict) -> dict:
    config = drafter_config(target_config)
    return config | {"architectures": ["DFlash2DraftModel"], "dflash_config": config["dflash_config"] | SELECTOR}


def make_qwen3_dflash2_tiny(out: Path, seed: int = 31, train: bool = True, steps: int = 80) -> None:
    """The target at `out`, its drafter at `drafter_dir(out)`."""
    from .dflash2 import CODEBOOKS
    from .dflash2_head import DFlash2Head

    def init(head, model):
        for conv in (c for layer in head.layers for c in (layer.attention_conv, layer.mlp_conv)):
            # Trained from the identity (DFlash's layers): zero base kernels would start every sublayer's input near 0
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight = 0.1 * conv.kernel_projection.weight

    def saved(weights: dict) -> dict:  # the codebooks named without `.weight`, as mlx-vlm's sanitize takes them
        return {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k: v
                for k, v in weights.items()}

    build_beside(out, make_qwen3_tiny, dflash2_config, DFlash2Head, seed, train, steps, logits_fn=block_logits,
                 init=init, saved=saved)


def block_logits(head, embed, lm_head, features: mx.array, seqs: mx.array, anchor: int, k: int) -> mx.array:
    """Every token's selector score [N, k, V] for the block anchored at `anchor`, each position's previous token the
    true one (seqs[:, anchor + i]): what it drafts for seqs[:, anchor + 1 : anchor + 1 + k]."""
    cache = [_Context() for _ in head.layers]
    head.context(features[:, :anchor], cache, 0)
    block = mx.concatenate([seqs[:, anchor:anchor + 1], mx.full((seqs.shape[0], k), head.mask_token_id,
                                                                   dtype=seqs.dtype)], axis=1)
    hidden = head.block(embed(block), cache, anchor)[:, 1:]
    logits = head.logits(hidden, lm_head)
    scores = head.candidate_selector.every_score(logits, hidden, seqs[:, anchor:anchor + k])
    # The scores' and the base logits' log-probabilities summed (a product of the two): the truth is learnt as
    # a candidate (the base logits' top-k) as well as chosen among them
    return nn.log_softmax(scores, axis=-1) + nn.log_softmax(logits, axis=-1)
