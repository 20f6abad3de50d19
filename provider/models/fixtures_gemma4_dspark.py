"""Fixture factory: `gemma4-dspark-tiny`, fixtures' tiny Gemma 4 target (as fixtures_gemma4_dflash's) and a Gemma 4
DSpark drafter (models.gemma4_dspark) beside it at fixtures_dflash.drafter_dir(target), in the layout mlx-vlm's
gemma4_dspark loads: `architectures: [Gemma4DSparkModel]`, `model_type: gemma4_text`, the DSpark keys flat (block_size
counting proposals, mask token 4, markov_rank 16), Gemma 4's attention geometry (global_head_dim 32 with one KV head,
keys as values) and RoPE per layer type (proportional, a quarter of the dimensions rotated), a final softcap, and
the tensors under `model.` with its own embedding and LM head.

The tapped layers are 2 (full attention) and 4 (a KV-shared sliding layer). The drafter's embedding and LM head start
as the target's tied embedding; all of it is distilled for seconds as fixtures_dspark's, each position corrected by
the true previous token.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .fixtures import make_gemma4_tiny
from .fixtures_dflash import BLOCK, build_beside
from .fixtures_dspark import RANK, block_logits

LAYER_IDS = [2, 4]
ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


def drafter_config(text: dict, layers: int = 2) -> dict:
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "final_logit_softcapping", "sliding_window")
    return {"architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text", "num_hidden_layers": layers,
            "intermediate_size": text["hidden_size"] * 2, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
            "layer_types": ["full_attention"] * layers, "rope_parameters": ROPE,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": False, "block_size": BLOCK - 1,
            "mask_token_id": 4, "target_layer_ids": LAYER_IDS, "num_target_layers": text["num_hidden_layers"],
            "markov_rank": RANK, "enable_confidence_head": False} | {k: text[k] for k in keys}


def make_gemma4_dspark_tiny(out: Path, seed: int = 31, train: bool = True, steps: int = 80) -> None:
    """The target at `out`, its drafter at `drafter_dir(out)`."""
    from .gemma4_dspark_head import Gemma4DSparkHead

    def init(head, model):
        table = model.language_model.model.embed_tokens.weight
        head.embed_tokens.weight, head.lm_head.weight = mx.array(table), mx.array(table)
        for i, layer in enumerate(head.layers):  # not ones, so that a layer that skips its scalar is caught
            layer.layer_scalar = mx.array([0.75 + 0.1 * i])

    build_beside(out, make_gemma4_tiny, drafter_config, Gemma4DSparkHead, seed, train, steps, logits_fn=block_logits,
                 layer_ids=LAYER_IDS, stride=1, init=init, saved=lambda w: {f"model.{k}": v for k, v in w.items()})
