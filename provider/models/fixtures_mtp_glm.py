"""Fixture factory: a tiny GLM-4.7-Flash (`glm4_moe_lite`) with its nextn (MTP) layer, in the published layout
(and a DeepSeek-V3 in the same layout).

`glm4_moe_lite-mtp-tiny`: written as Hugging Face publishes GLM-4.7-Flash: `model.*` and `lm_head.weight`, MLA's
fused `kv_b_proj`, experts one tensor per expert (`mlp.experts.<e>.{gate,up,down}_proj`), the router's
`mlp.gate.weight` and float32 `e_score_correction_bias`, a shared expert; and the nextn layer as
`model.layers.<num_hidden_layers>.*`: its own `embed_tokens`, `enorm` / `hnorm` / `eh_proj`, an MLA `self_attn`, a
MoE `mlp` with shared expert, `shared_head.norm` and an untied `shared_head.head`. Random, seeded weights (routers
random too, so no expert ties); the head is untrained and rarely agrees with its target.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import CHATML_TEMPLATE, _save, build_tokenizer
from .fixtures_mtp import HF_METADATA


def glm_config(ids: dict[str, int], vocab: int = 384, **sizes) -> dict:
    return {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "vocab_size": vocab,
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "routed_scaling_factor": 1.8, "kv_lora_rank": 32, "q_lora_rank": 48,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "moe_layer_freq": 1,
            "first_k_dense_replace": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "partial_rotary_factor": 1.0, "attention_bias": False, "tie_word_embeddings": False,
            "num_nextn_predict_layers": 1, "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32"} | sizes


def _hf_names(params: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """mlx-lm's glm4_moe_lite parameter names and shapes -> the published ones (inverse of its sanitize)."""
    out = {}
    for name, value in params.items():
        if ".switch_mlp." in name:  # [E, out, in] -> one tensor per expert
            base, proj = name.split(".switch_mlp.")
            for e in range(value.shape[0]):
                out[f"{base}.experts.{e}.{proj}"] = value[e]
        elif name.endswith("self_attn.embed_q.weight"):  # [heads, kv_lora, nope] and [heads, v, kv_lora] -> fused
            wv = params[name.replace("embed_q", "unembed_out")]
            kv_b = mx.concatenate([value.swapaxes(-1, -2), wv], axis=1)
            out[name.replace("embed_q", "kv_b_proj")] = kv_b.reshape(-1, config["kv_lora_rank"])
        elif not name.endswith("self_attn.unembed_out.weight"):
            out[name] = value
    return out


def spread(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """A random MLA + MoE model's parameters made fit to decode: routers random (mlx-lm initialises them to zeros:
    every expert tied), correction biases small, the token embedding halved (as fixtures._random_weights: fewer
    near-ties in the logits). In place, in the parameters' order (the fixtures' seeds depend on it)."""
    for name in list(params):
        if name.endswith("mlp.gate.weight"):
            params[name] = 0.5 * mx.random.normal(params[name].shape)
        elif name.endswith("e_score_correction_bias"):
            params[name] = 0.05 * mx.random.normal(params[name].shape)
        elif "embed" in name and "embed_q" not in name:
            params[name] = params[name] * 0.5
    return params


def make_glm4_moe_lite_mtp_tiny(out: Path, seed: int = 21, **overrides) -> None:
    import importlib

    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)
    config = glm_config(ids) | overrides
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    n, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    mx.random.seed(seed)
    # One layer more than the target: the last is the nextn layer's decoder block (a MoE layer, as published).
    model = family.Model(family.ModelArgs.from_dict(config | {"num_hidden_layers": n + 1}))
    params = spread(dict(tree_flatten(model.parameters())))
    nextn = f"model.layers.{n}."
    params |= {nextn + "embed_tokens.weight": 0.5 * mx.random.normal((vocab, hidden)),
               nextn + "enorm.weight": mx.ones((hidden,)), nextn + "hnorm.weight": mx.ones((hidden,)),
               nextn + "eh_proj.weight": mx.random.normal((hidden, 2 * hidden)) * (2 * hidden) ** -0.5,
               nextn + "shared_head.norm.weight": 1.0 + 0.1 * mx.random.normal((hidden,)),
               nextn + "shared_head.head.weight": mx.random.normal((vocab, hidden)) * hidden ** -0.5}
    # Values a bfloat16 checkpoint holds (as the published one), stored as float32 for MLX's CPU (its expert
    # matmul takes float32 only): mlx-vlm's split casts the head to bfloat16, losslessly then.
    weights = {k: v if "e_score_correction_bias" in k else v.astype(mx.bfloat16).astype(mx.float32)
               for k, v in _hf_names(params, config).items()}
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)


def make_deepseek_v3_mtp_tiny(out: Path) -> None:
    """`deepseek_v3-mtp-tiny`: the same layout under DeepSeek-V3's model type, its nextn layer at model.layers.61 as
    published (mlx-lm's deepseek_v3 sanitize drops that layer by its number): 61 dense target layers, tiny, and the
    nextn layer a MoE one; bfloat16 values, not the published fp8 blocks."""
    make_glm4_moe_lite_mtp_tiny(out, seed=22, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                                num_hidden_layers=61, first_k_dense_replace=61, intermediate_size=64)
