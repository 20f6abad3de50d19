"""Fixture factory: a tiny K-EXAONE (`exaone_moe`: sliding-window and global attention layers with q/k norms, a dense
first layer then MoE layers with a shared expert) with its MTP layer in the published layout.

`exaone_moe-mtp-tiny`: `model.*` and `lm_head.weight`, experts one tensor per expert, the router's
`mlp.e_score_correction_bias`; and the MTP layer as `mtp.fc` [H, 2H], `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (a sliding-window attention with a dense MLP) and `mtp.norm`, with
`num_nextn_predict_layers: 1`, `mtp_layer_types: ["sliding_attention"]`; no embedding or LM head of its own. The
window is 8. Random, seeded weights (routers random, the LM head scaled so its logits are as peaked as a trained
model's); the head distilled briefly on its target.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures_mtp import chatml_tokenizer, experts_apart, write_and_distil


def exaone_config(ids: dict[str, int], vocab: int = 384) -> dict:
    return {"architectures": ["ExaoneMoEForCausalLM"], "model_type": "exaone_moe", "vocab_size": vocab,
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "num_shared_experts": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
            "sliding_window": 8, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "is_moe_layer": [False, True, True, True], "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_theta": 1e6, "tie_word_embeddings": False,
            "num_nextn_predict_layers": 1, "mtp_layer_types": ["sliding_attention"], "mtp_sliding_windows": [8],
            "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32"}


def published_head(head) -> dict[str, mx.array]:
    """The head's parameters as the published MTP layer: `mtp.*`, its block `mtp.layers.0.*`, its final norm
    `mtp.norm`."""
    return {"mtp." + name.replace("block.", "layers.0.", 1).replace("final_layernorm.", "norm.", 1): v
            for name, v in tree_flatten(head.parameters())}


def make_exaone_moe_mtp_tiny(out: Path, seed: int = 39, steps: int = 100) -> None:
    from mlx_lm.models import exaone_moe

    from .exaone_moe_mtp import ExaoneMoeMTPHead, load_head

    config = exaone_config(chatml_tokenizer(out))
    mx.random.seed(seed)
    model = exaone_moe.Model(exaone_moe.ModelArgs.from_dict(config))
    weights = experts_apart(model, random_routers=True) | published_head(ExaoneMoeMTPHead(model.args, config))
    write_and_distil(out, config, weights, load_head, published_head, steps)
