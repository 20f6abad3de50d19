"""Fixture factory: a tiny GLM-5 (`glm_moe_dsa`: MLA with DeepSeek sparse attention, MoE) with its nextn (MTP) layer
in the published layout.

`glm_moe_dsa-mtp-tiny`: written as Hugging Face publishes GLM-5: `model.*` and `lm_head.weight`, MLA's fused
`kv_b_proj`, each layer's indexer (`self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`), experts one tensor per
expert, the router's float32 `e_score_correction_bias`, a shared expert; and the nextn layer as
`model.layers.<num_hidden_layers>.*`: `enorm` / `hnorm` / `eh_proj`, the decoder layer (its indexer too) and
`shared_head.norm`, with no embed_tokens or shared_head.head of its own (GLM-5's nextn layer ships none: the
target's are used, as mlx-vlm's glm_moe_dsa_mtp drafter binds them). index_topk is 8, so prompts past 8 tokens
take the sparse path in the target and in the head. Random, seeded weights (bfloat16 values stored float32, for
MLX's CPU expert matmul), the head distilled briefly on its target so that its drafts are often accepted.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import CHATML_TEMPLATE, _save, build_tokenizer
from .fixtures_mtp import HF_METADATA, distil_head
from .fixtures_mtp_glm import _hf_names, glm_config, spread


def glm5_config(ids: dict[str, int], **sizes) -> dict:
    config = {k: v for k, v in glm_config(ids).items() if k not in ("rope_theta", "partial_rotary_factor")}
    return config | {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "index_head_dim": 16,
                     "index_n_heads": 4, "index_topk": 8, "indexer_rope_interleave": True,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}} | sizes


def _bf16(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k: v if "e_score_correction_bias" in k else v.astype(mx.bfloat16).astype(mx.float32)
            for k, v in weights.items()}


def published_head(head, config: dict) -> dict[str, mx.array]:
    """The head's parameters (glm4_moe_lite_mtp's names, mlx-lm's layout) as the published nextn layer."""
    nextn = f"model.layers.{config['num_hidden_layers']}."
    params = {nextn + k.removeprefix("block."): v for k, v in tree_flatten(head.parameters())}
    return _bf16(_hf_names(params, config))


def make_glm_moe_dsa_mtp_tiny(out: Path, seed: int = 23, train: bool = True, steps: int = 120) -> None:
    from mlx_lm.models import glm_moe_dsa

    out.mkdir(parents=True, exist_ok=True)
    config = glm5_config(build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False))
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    mx.random.seed(seed)
    # One layer more than the target: the last is the nextn layer's decoder layer (a MoE layer, as published).
    model = glm_moe_dsa.Model(glm_moe_dsa.ModelArgs.from_dict(config | {"num_hidden_layers": n + 1}))
    params = spread(dict(tree_flatten(model.parameters())))
    nextn = f"model.layers.{n}."
    params |= {nextn + "enorm.weight": mx.ones((hidden,)), nextn + "hnorm.weight": mx.ones((hidden,)),
               nextn + "eh_proj.weight": mx.random.normal((hidden, 2 * hidden)) * (2 * hidden) ** -0.5,
               nextn + "shared_head.norm.weight": 1.0 + 0.1 * mx.random.normal((hidden,))}
    weights = _bf16(_hf_names(params, config))
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    if train:
        train_head(out, config, steps)


def train_head(out: Path, config: dict, steps: int, seed: int = 12) -> float:
    """The nextn layer distilled on its target's greedy continuations (fixtures_mtp.distil_head), written back in
    the published layout. Returns its training accuracy."""
    from .glm4_moe_lite_mtp import load_head

    head, accuracy = distil_head(out, load_head, lambda m: (m.model.embed_tokens, m.lm_head), steps, seed)
    weights = dict(mx.load(str(out / "model.safetensors"))) | published_head(head, config)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    return accuracy
