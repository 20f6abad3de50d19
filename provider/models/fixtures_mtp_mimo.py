"""Fixture factory: a tiny Xiaomi MiMo (`mimo`: Qwen2-style layers, biased q/k/v) with its MTP layer in the published
layout.

`mimo-mtp-tiny`: written as Hugging Face publishes MiMo-7B: `model.*` and `lm_head.weight`, and the MTP layer as
`model.mtp_layers.0.*` with `num_nextn_predict_layers: 1`: `token_layernorm`, `hidden_layernorm`, `input_proj`
[H, 2H], `final_layernorm`, and the decoder layer's `input_layernorm`, `self_attn.{q,k,v}_proj.{weight,bias}`,
`self_attn.o_proj.weight`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj.weight` (16 tensors, as released);
no embedding or LM head of its own. Random, seeded weights, the head distilled briefly on its target so that its
drafts are often accepted.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures_mtp import chatml_tokenizer, write_and_distil


def mimo_config(ids: dict[str, int], vocab: int = 384, **sizes) -> dict:
    return {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "vocab_size": vocab, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "attention_bias": True, "rms_norm_eps": 1e-5, "rope_theta": 640000.0, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "eos_token_id": ids["<|im_end|>"],
            "torch_dtype": "float32"} | sizes


def published_head(head) -> dict[str, mx.array]:
    """The head's parameters as the published MTP layer (`model.mtp_layers.0.*`, no `block.`)."""
    return {"model.mtp_layers.0." + k.removeprefix("block."): v for k, v in tree_flatten(head.parameters())}


def make_mimo_mtp_tiny(out: Path, seed: int = 31, train: bool = True, steps: int = 80) -> None:
    from mlx_lm.models import mimo

    from .mimo_mtp import MiMoMTPHead, load_head

    config = mimo_config(chatml_tokenizer(out))
    mx.random.seed(seed)
    model = mimo.Model(mimo.ModelArgs.from_dict(config))
    weights = {k: v * 0.5 if "embed" in k else v for k, v in tree_flatten(model.parameters())}  # fewer near-ties
    weights |= published_head(MiMoMTPHead(model.args))
    write_and_distil(out, config, weights, load_head, published_head, steps if train else 0)
