"""Fixture factory: a tiny ERNIE-4.5 MoE (`ernie4_5_moe`: a dense first layer, then MoE layers with a shared expert,
interleaved RoPE) with its MTP layer in the published layout.

`ernie4_5_moe-mtp-tiny`: written as Hugging Face publishes ERNIE-4.5-*-PT: `model.*` and `lm_head.weight`, experts
one tensor per expert (`mlp.experts.<e>.{gate,up,down}_proj.weight`), `mlp.shared_experts.*`; and the MTP layer as
`model.mtp_emb_norm.0.weight`, `model.mtp_hidden_norm.0.weight`, `model.mtp_linear_proj.0.weight` [H, 2H] and a
dense decoder layer `model.mtp_block.0.*` (q/k/v/o, input / post-attention norms, gate/up/down), with
`num_nextn_predict_layers: 1`; no embedding or LM head of its own. Random, seeded weights (the LM head scaled, so its
logits are as peaked as a trained model's), the head distilled briefly on its target.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures_mtp import chatml_tokenizer, experts_apart, write_and_distil


def ernie_config(ids: dict[str, int], vocab: int = 384) -> dict:
    return {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "vocab_size": vocab,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 500000.0, "use_bias": False,
            "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1, "moe_layer_interval": 1, "moe_gate_act": "softmax", "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
            "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32"}


def published_head(head) -> dict[str, mx.array]:
    """The head's parameters as the published MTP layer: `model.<part>.0.<rest>`."""
    return {"model.{}.0.{}".format(*name.split(".", 1)): v for name, v in tree_flatten(head.parameters())}


def make_ernie4_5_moe_mtp_tiny(out: Path, seed: int = 37, steps: int = 100) -> None:
    from mlx_lm.models import ernie4_5_moe

    from .ernie4_5_mtp import Ernie45MTPHead, load_head

    config = ernie_config(chatml_tokenizer(out))
    mx.random.seed(seed)
    model = ernie4_5_moe.Model(ernie4_5_moe.ModelArgs.from_dict(config))
    weights = experts_apart(model) | published_head(Ernie45MTPHead(model.args))
    write_and_distil(out, config, weights, load_head, published_head, steps)
