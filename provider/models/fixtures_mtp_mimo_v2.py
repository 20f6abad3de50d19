"""Fixture factory: a tiny MiMo-V2-Flash (`mimo_v2_flash`: full and sliding-window attention layers with sinks, MoE)
with its first MTP layer in the published layout.

`mimo_v2_flash-mtp-tiny`: `model.*` and `lm_head.weight` (experts one tensor per expert), and the MTP layer as
`model.mtp.layers.0.*`: `enorm` / `hnorm` / `eh_proj`, a sliding-window attention (its sinks too) with a dense MLP,
`input_layernorm` / `pre_mlp_layernorm`, `final_layernorm`; no embedding or LM head of its own. The window is 8, so
prompts past 8 tokens slide in target and head. Random, seeded weights; the head distilled briefly on its target.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures_mtp import chatml_tokenizer, write_and_distil
from .fixtures_mtp_glm import _hf_names, spread

PREFIX = "model.mtp.layers.0."


def mimo_v2_config(ids: dict[str, int], vocab: int = 384) -> dict:
    return {"architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "vocab_size": vocab,
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
            "hybrid_layer_pattern": [0, 1, 1], "moe_layer_freq": [0, 1, 1], "add_swa_attention_sink_bias": True,
            "add_full_attention_sink_bias": False, "sliding_window_size": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "v_head_dim": 16, "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 2, "swa_head_dim": 16, "swa_v_head_dim": 8, "rope_theta": 5e6,
            "swa_rope_theta": 1e4, "partial_rotary_factor": 0.5, "n_shared_experts": None, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "routed_scaling_factor": None, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
            "max_position_embeddings": 2048, "layernorm_epsilon": 1e-5, "tie_word_embeddings": False,
            "num_nextn_predict_layers": 1, "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32"}


def published_head(head) -> dict[str, mx.array]:
    """The head's parameters as the published MTP layer (`model.mtp.layers.0.*`, no `block.`)."""
    return {PREFIX + k.removeprefix("block.").replace("post_attention_layernorm", "pre_mlp_layernorm"): v
            for k, v in tree_flatten(head.parameters())}


def make_mimo_v2_flash_mtp_tiny(out: Path, seed: int = 33, steps: int = 120) -> None:
    from mlx_lm.models import mimo_v2_flash

    from .mimo_v2_mtp import MiMoV2MTPHead, load_head

    config = mimo_v2_config(chatml_tokenizer(out))
    mx.random.seed(seed)
    model = mimo_v2_flash.Model(mimo_v2_flash.ModelArgs.from_dict(config))
    weights = _hf_names(spread(dict(tree_flatten(model.parameters()))), config)
    weights |= published_head(MiMoV2MTPHead(model.args))
    write_and_distil(out, config, weights, load_head, published_head, steps)
