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

from .fixtures import CHATML_TEMPLATE, _save, build_tokenizer
from .fixtures_mtp import HF_METADATA, distil_head


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

    from .mimo_mtp import MiMoMTPHead

    out.mkdir(parents=True, exist_ok=True)
    config = mimo_config(build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False))
    mx.random.seed(seed)
    model = mimo.Model(mimo.ModelArgs.from_dict(config))
    weights = {k: v * 0.5 if "embed" in k else v for k, v in tree_flatten(model.parameters())}  # fewer near-ties
    weights |= published_head(MiMoMTPHead(model.args))
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    if train:
        train_head(out, steps)


def train_head(out: Path, steps: int, seed: int = 12) -> float:
    """The MTP layer distilled on its target's greedy continuations (fixtures_mtp.distil_head), written back in the
    published layout. Returns its training accuracy."""
    from .mimo_mtp import load_head

    head, accuracy = distil_head(out, load_head, lambda m: (m.model.embed_tokens, m.lm_head), steps, seed)
    weights = dict(mx.load(str(out / "model.safetensors"))) | published_head(head)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    return accuracy
