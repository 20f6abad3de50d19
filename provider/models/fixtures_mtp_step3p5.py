"""Fixture factory: a tiny Step-3.5-Flash (`step3p5`: full and sliding-window attention layers with per-layer RoPE,
q/k norms and a head-wise gate, MoE with a shared expert) with its first MTP layer in the published layout.

`step3p5-mtp-tiny`: written as Hugging Face publishes Step-3.5-Flash: `model.*` and `lm_head.weight`, every norm
zero-centred, MoE layers as `moe.{gate,up,down}_proj.weight` [E, out, in], `moe.gate.weight`, `moe.router_bias`,
`share_expert.*`; and the MTP layer as `model.layers.<num_hidden_layers>.*`: `enorm` / `hnorm` / `eh_proj`, a
sliding-window attention (the sliding head counts of attention_other_setting) with a dense MLP,
`transformer.shared_head.norm` and its own `transformer.shared_head.output` (an LM head); layer_types, rope_theta
and partial_rotary_factors run one entry past the target's layers, as the release's run past its 45. The window is
8, so prompts past 8 tokens slide in target and head. Random, seeded weights (norms spread about 1); the head (its
LM head a copy of the target's at first) distilled briefly on its target's hidden states before the final norm,
which it reads.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import CHATML_TEMPLATE, _save, build_tokenizer
from .fixtures_mtp import HF_METADATA, distil_head

# mlx-lm's step3p5 names -> the published ones (the inverse of its sanitize's remappings).
_PUBLISHED = ((".mlp.switch_mlp.", ".moe."), (".mlp.gate.gate.", ".moe.gate."),
              (".mlp.gate.router_bias", ".moe.router_bias"), (".mlp.share_expert.", ".share_expert."))


def step3p5_config(ids: dict[str, int], vocab: int = 384) -> dict:
    layers = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
    return {"architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5", "vocab_size": vocab,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_attention_groups": 2, "head_dim": 16, "att_impl_type": "GQA",
            "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 8,
                                        "num_attention_groups": 4, "head_dim": 16, "true_head_dim": 16},
            "layer_types": layers + ["sliding_attention"], "sliding_window": 8,
            "rope_theta": [5e6, 1e4, 1e4, 1e4, 1e4], "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0, 1.0],
            "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 1024,
                             "low_freq_factor": 1.0, "high_freq_factor": 32.0},
            "yarn_only_types": ["full_attention"], "use_head_wise_attn_gate": True, "moe_num_experts": 4,
            "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 32, "moe_layers_enum": "1,2,3",
            "moe_router_scaling_factor": 3.0, "norm_expert_weight": True, "use_moe_router_bias": True,
            "need_fp32_gate": True, "swiglu_limits": [0, 0, 7, 7, 0], "swiglu_limits_shared": [0, 0, 0, 0, 7],
            "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "num_nextn_predict_layers": 1, "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32"}


def _zero_centred(name: str, value: mx.array) -> mx.array:
    return value - 1.0 if "norm" in name and name.endswith(".weight") else value


def published_target(model) -> dict[str, mx.array]:
    """The target's tensors as published, its norms spread about 1 (mlx-lm initialises them to ones, under which
    the hidden before the final norm and after it would norm alike in the head's hnorm) and its LM head scaled."""
    out = {}
    for name, value in tree_flatten(model.parameters()):
        if "norm" in name:
            value = value + 0.3 * mx.random.normal(value.shape)
        elif name == "lm_head.weight":
            value = value * 4  # logits as peaked as a trained model's: sampled drafts accepted often enough
        for ours, theirs in _PUBLISHED:
            name = name.replace(ours, theirs)
        out[name] = _zero_centred(name, value * 0.5 if "embed" in name else value)  # halved: fewer near-ties
    return out


def published_head(head, layer: int) -> dict[str, mx.array]:
    """The head's parameters as the published MTP layer (`model.layers.<layer>.*`, no `block.`, its shared head
    under `transformer.`, norms zero-centred)."""
    out = {}
    for name, value in tree_flatten(head.parameters()):
        name = name.removeprefix("block.")
        name = "transformer." + name if name.startswith("shared_head.") else name
        out[f"model.layers.{layer}.{name}"] = _zero_centred(name, value)
    return out


def make_step3p5_mtp_tiny(out: Path, seed: int = 35, steps: int = 120) -> None:
    from mlx_lm.models import step3p5

    from .step3p5_mtp import Step3p5MTPHead

    out.mkdir(parents=True, exist_ok=True)
    config = step3p5_config(build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False))
    mx.random.seed(seed)
    model = step3p5.Model(step3p5.ModelArgs.from_dict(config))
    head = Step3p5MTPHead(model.args)
    weights = published_target(model)
    head.shared_head.output.weight = weights["lm_head.weight"]  # the distillation starts from the target's LM head
    weights |= published_head(head, config["num_hidden_layers"])
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    if steps:
        train_head(out, steps, config["num_hidden_layers"])


def train_head(out: Path, steps: int, layer: int, seed: int = 12) -> float:
    """The MTP layer distilled (fixtures_mtp.distil_head, on the hidden before the target's final norm, through
    its own shared head) and written back in the published layout. Returns its training accuracy."""
    from .step3p5_mtp import load_head

    loaded = []

    def load(path, model):
        loaded.append(load_head(path, model))
        return loaded[0]

    def parts(model):  # the head's logits: its own LM head over shared_head.norm
        return model.model.embed_tokens, lambda h: loaded[0].lm_head(loaded[0].readout(h))

    head, accuracy = distil_head(out, load, parts, steps, seed)
    weights = dict(mx.load(str(out / "model.safetensors"))) | published_head(head, layer)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    return accuracy
