"""Fixture factory: `laguna-dflash-tiny`, a tiny Laguna target (mlx-lm's laguna: gated attention, three sliding layers
of window 16 then a full one with partial rotary, a dense first MLP then MoE layers of 4 experts) and a Laguna DFlash
drafter (models.laguna_dflash) beside it at fixtures_dflash.drafter_dir(target), in the layout mlx-vlm's laguna_dflash
loads: `model_type: laguna` with its dflash_config (causal), per-head gating, two sliding layers of window 24 tapping
the target's layers 1 and 2, `aux_hidden_norms`, fused `qkv_proj` and `g_proj`, tensors under `model.`.

The drafter is distilled for seconds as fixtures_dflash's, under its window and causal block.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .fixtures import CHATML_TEMPLATE, _mkdir, _random_weights, _save, build_tokenizer
from .fixtures_dflash import BLOCK, build_beside

LAYER_IDS = [1, 2]
WINDOW = 24


def make_laguna_tiny(out: Path, seed: int = 13) -> None:
    ids = build_tokenizer(_mkdir(out), 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)
    config = {"architectures": ["LagunaForCausalLM"], "model_type": "laguna", "hidden_size": 64, "num_hidden_layers": 4,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 384, "rms_norm_eps": 1e-6, "gating": True, "sliding_window": 16,
              "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
              "rope_parameters": {"full_attention": {"rope_theta": 500000.0, "rope_type": "default",
                                                     "partial_rotary_factor": 0.5},
                                  "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
              "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 1024,
              "tie_word_embeddings": False, "eos_token_id": ids["<|im_end|>"]}
    _save(out, config, _random_weights(config, seed=seed))


def drafter_config(target: dict) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size")
    layers = len(LAYER_IDS)
    return {"architectures": ["LagunaDFlashDraftModel"], "model_type": "laguna", "num_hidden_layers": layers,
            "gating": "per-head", "layer_types": ["sliding_attention"] * layers, "sliding_window": WINDOW,
            "sliding_windows": [WINDOW] * layers, "rope_theta": 1000000.0, "draft_vocab_size": target["vocab_size"],
            "eagle_aux_hidden_state_layer_ids": LAYER_IDS,
            "dflash_config": {"block_size": BLOCK, "mask_token_id": target["vocab_size"] - 2,
                              "target_layer_ids": LAYER_IDS, "num_target_layers": target["num_hidden_layers"],
                              "causal": True}} | {k: target[k] for k in keys}


def fused(weights: dict) -> dict:
    """The head's q/k/v_proj as the checkpoint's one qkv_proj (rows q, k, v), under `model.`."""
    out = {}
    for name, value in weights.items():
        if name.endswith("self_attn.q_proj.weight"):
            prefix = name[:-len("q_proj.weight")]
            value = mx.concatenate([weights[prefix + p + "_proj.weight"] for p in "qkv"])
            name = prefix + "qkv_proj.weight"
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            continue
        out["model." + name] = value
    return out


def make_laguna_dflash_tiny(out: Path, seed: int = 41, train: bool = True, steps: int = 80) -> None:
    """The target at `out`, its drafter at `drafter_dir(out)`, its q/k/v fused."""
    from .laguna_dflash_head import LagunaHead

    build_beside(out, make_laguna_tiny, drafter_config, LagunaHead, seed, train, steps, layer_ids=LAYER_IDS, stride=1,
                 saved=fused)
