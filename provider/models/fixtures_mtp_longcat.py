"""Fixture factory: a tiny LongCat-Flash (`longcat_flash`: layers of two MLAs and two dense MLPs around a MoE with
identity "zero" experts) with its MTP layer in the published layout.

`longcat_flash-mtp-tiny`: written as meituan-longcat/LongCat-Flash-Chat publishes it: `model.*` and
`lm_head.weight`, experts one tensor per expert (`mlp.experts.<e>.{gate,up,down}_proj.weight`), MLA's `kv_b_proj`
whole; and the MTP layer as `model.mtp.embed_tokens.weight` (the target's embedding), `model.mtp.layers.0.eh_proj`
[H, 2H], `.enorm.m` / `.hnorm.m`, a dense layer (`input_layernorm`, `self_attn.*` one MLA, `post_attention_layernorm`,
`transformer_layer.mlp.*`) and `model.mtp.norm`; `num_nextn_predict_layers: 1`. Random, seeded
weights (the LM head scaled, so its logits are as peaked as a trained model's), the head distilled briefly.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures_mtp import chatml_tokenizer, experts_apart, write_and_distil

# the head's name -> the published one (after `model.mtp.`), first match wins
_PUBLISHED = (("embed_tokens.", "embed_tokens."), ("enorm.", "layers.0.enorm.m."), ("hnorm.", "layers.0.hnorm.m."),
              ("mlp.", "layers.0.transformer_layer.mlp."), ("final_layernorm.", "norm."), ("", "layers.0."))


def longcat_config(ids: dict[str, int], vocab: int = 384) -> dict:
    return {"architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash", "vocab_size": vocab,
            "hidden_size": 64, "ffn_hidden_size": 96, "expert_ffn_hidden_size": 32, "num_layers": 2,
            "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 2,
            "zero_expert_type": "identity", "routed_scaling_factor": 2.0, "attention_method": "MLA",
            "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "attention_bias": False, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "num_nextn_predict_layers": 1, "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32"}


def kv_b_proj(attn: dict[str, mx.array]) -> mx.array:
    """MLA's published kv_b_proj [heads * (nope + v), kv_lora] from mlx-lm's embed_q [heads, kv_lora, nope] and
    unembed_out [heads, v, kv_lora] (what mlx-lm's sanitize splits it into)."""
    w = mx.concatenate([attn["embed_q.weight"].swapaxes(-1, -2), attn["unembed_out.weight"]], axis=1)
    return w.reshape(-1, w.shape[-1])


def published_mla(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """`weights` with every MLA's embed_q / unembed_out joined back into its kv_b_proj."""
    out, split = {}, {}
    for name, value in weights.items():
        for part in ("embed_q.weight", "unembed_out.weight"):
            if name.endswith("." + part):
                split.setdefault(name[:-len(part)], {})[part] = value
                break
        else:
            out[name] = value
    return out | {prefix + "kv_b_proj.weight": kv_b_proj(attn) for prefix, attn in split.items()}


def published_head(head) -> dict[str, mx.array]:
    """The head's parameters as the published MTP layer (`model.mtp.*`)."""
    out = {}
    for name, value in tree_flatten(head.parameters()):
        ours, theirs = next((o, t) for o, t in _PUBLISHED if name.startswith(o))
        out["model.mtp." + theirs + name[len(ours):]] = value
    return published_mla(out)


def make_longcat_flash_mtp_tiny(out: Path, seed: int = 41, steps: int = 100) -> None:
    from mlx_lm.models import longcat_flash

    from .longcat_flash_mtp import LongcatFlashMTPHead, load_head

    config = longcat_config(chatml_tokenizer(out))
    mx.random.seed(seed)
    model = longcat_flash.Model(longcat_flash.ModelArgs.from_dict(config))
    target = published_mla(experts_apart(model))
    head = LongcatFlashMTPHead(model.args)
    head.embed_tokens.weight = target["model.embed_tokens.weight"]  # shipped as a copy of the target's
    write_and_distil(out, config, target | published_head(head), load_head, published_head, steps)
