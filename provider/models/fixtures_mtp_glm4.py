"""Fixture factory: a tiny GLM-4.5 (`glm4_moe`) and a tiny DeepSeek-V3.2 (`deepseek_v32`), each with its nextn (MTP)
layer in the published layout.

`glm4_moe-mtp-tiny`: written as Hugging Face publishes GLM-4.5 / 4.6 / 4.7: `model.*` and `lm_head.weight`,
grouped-query attention (biased q/k/v, partial RoPE 0.5, q/k norms), experts one tensor per expert, the router's
float32 `e_score_correction_bias`, a shared expert; and the nextn layer as `model.layers.<num_hidden_layers>.*`:
its own `embed_tokens` and `shared_head.head` (copies of the target's), `enorm` / `hnorm` / `eh_proj`, the decoder
layer and `shared_head.norm`. `deepseek_v32-mtp-tiny`: GLM-5's tiny DSA layout under DeepSeek-V3.2's model type,
its nextn layer shipping its own embedding and LM head as DeepSeek's does. Random, seeded weights (bfloat16 values
stored float32, for MLX's CPU expert matmul); each head distilled briefly on its target so drafts are accepted.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import CHATML_TEMPLATE, _save, build_tokenizer
from .fixtures_mtp import HF_METADATA
from .fixtures_mtp_glm import _hf_names, glm_config, spread
from .fixtures_mtp_glm5 import _bf16, glm5_config, train_head


def glm4_config(ids: dict[str, int], **sizes) -> dict:
    mla = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    config = {k: v for k, v in glm_config(ids).items() if k not in mla}
    return config | {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_key_value_heads": 2,
                     "head_dim": 16, "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True,
                     "rope_scaling": None} | sizes


def _make(out: Path, config: dict, seed: int, steps: int) -> None:
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    mx.random.seed(seed)
    # One layer more than the target: the last is the nextn layer's decoder layer (a MoE layer, as published).
    model = family.Model(family.ModelArgs.from_dict(config | {"num_hidden_layers": n + 1}))
    params = spread(dict(tree_flatten(model.parameters())))
    nextn = f"model.layers.{n}."
    params |= {nextn + "embed_tokens.weight": params["model.embed_tokens.weight"],
               nextn + "enorm.weight": mx.ones((hidden,)), nextn + "hnorm.weight": mx.ones((hidden,)),
               nextn + "eh_proj.weight": mx.random.normal((hidden, 2 * hidden)) * (2 * hidden) ** -0.5,
               nextn + "shared_head.norm.weight": 1.0 + 0.1 * mx.random.normal((hidden,)),
               nextn + "shared_head.head.weight": params["lm_head.weight"]}
    weights = _bf16(_hf_names(params, config))
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    if steps:
        train_head(out, config, steps)  # its own embedding and LM head equal the target's: trained through those


def make_glm4_moe_mtp_tiny(out: Path, steps: int = 120) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _make(out, glm4_config(build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)), 24, steps)


def make_deepseek_v32_mtp_tiny(out: Path, steps: int = 120) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = glm5_config(build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False),
                         model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"])
    _make(out, config, 25, steps)
