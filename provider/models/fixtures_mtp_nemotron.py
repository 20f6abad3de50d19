"""Fixture factory: a tiny Nemotron-H target carrying its MTP head, in the layout Hugging Face publishes.

`nemotron_h-mtp-tiny`: a hybrid of Mamba2 ("M"), attention ("*"), MoE ("E") and MLP ("-") blocks chosen by
`hybrid_override_pattern`, written as NVIDIA's checkpoints are (`backbone.*`, `lm_head.weight`, conv1d [C, 1, K],
experts one tensor each: `mixer.experts.{e}.up_proj` / `down_proj`), with `mtp.*` head weights of the head's own
pattern (`mtp_hybrid_override_pattern`, attention then MoE; `enorm` / `hnorm` / `eh_proj` on its first block,
`final_layernorm` on its last) and `num_nextn_predict_layers` = 1. Random, seeded weights, the head then distilled
briefly on its target's greedy continuations of `fixtures_mtp.train_prompts` (as the Qwen3.5 fixture's): on those
its drafts are often accepted, elsewhere seldom, so rounds accept every number of drafts from 0 to k and the
Mamba2 layers are rolled back from every point of a round.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import CHATML_TEMPLATE, _save, build_tokenizer
from .fixtures_mtp import HF_METADATA, distil_head

PATTERN, HEAD_PATTERN = "M*ME-M", "*E"
_STACKED = re.compile(r"^(.*\.mixer)\.switch_mlp\.(fc1|fc2)\.weight$")


def nemotron_h_config(ids: dict[str, int], vocab: int = 384, hidden: int = 64, **sizes) -> dict:
    config = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": len(PATTERN),
              "hybrid_override_pattern": PATTERN, "max_position_embeddings": 2048, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False, "mamba_num_heads": 8,
              "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4,
              "n_groups": 2, "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
              "use_conv_bias": True, "time_step_limit": [0.0, float("inf")], "moe_intermediate_size": 32,
              "moe_shared_expert_intermediate_size": 48, "n_group": 1, "n_routed_experts": 4, "n_shared_experts": 1,
              "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
              "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": HEAD_PATTERN,
              "tie_word_embeddings": False, "eos_token_id": ids["<|im_end|>"]}
    return config | sizes


def _published(name: str, value: mx.array) -> dict[str, mx.array]:
    """One of mlx-lm's parameters as the published checkpoint stores it (experts unstacked, conv [C, 1, K])."""
    stacked = _STACKED.match(name)
    if stacked:
        proj = {"fc1": "up_proj", "fc2": "down_proj"}[stacked.group(2)]
        return {f"{stacked.group(1)}.experts.{e}.{proj}.weight": value[e] for e in range(value.shape[0])}
    if "conv1d.weight" in name:
        value = value.moveaxis(2, 1)  # mlx-lm's [C, K, 1] -> Hugging Face's [C, 1, K]
    return {name: value}


def _randomised(name: str, value: mx.array) -> mx.array:
    if name.endswith("norm.weight"):  # every norm, the head's enorm / hnorm / final_layernorm too
        return 1.0 + 0.1 * mx.random.normal(value.shape)  # norms not all ones: a loader mixing them up shows
    if name.endswith(("gate.weight", "e_score_correction_bias")):
        return 0.5 * mx.random.normal(value.shape)  # mlx-lm initialises the router to zeros: every score tied
    if "embeddings" in name:
        return value * 0.5  # as fixtures._random_weights: fewer near-ties in a tiny random model's logits
    return value


def make_nemotron_h_mtp_tiny(out: Path, seed: int = 13, train: bool = True, **sizes) -> None:
    from mlx_lm.models import nemotron_h

    from .nemotron_h_mtp import NemotronHMTPHead

    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)
    config = nemotron_h_config(ids, **sizes)
    mx.random.seed(seed)
    model = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(config))
    args = nemotron_h.ModelArgs.from_dict(config | {"hybrid_override_pattern": HEAD_PATTERN})
    head = NemotronHMTPHead(args, list(HEAD_PATTERN))
    weights = {}
    for prefix, module in (("", model), ("mtp.", head)):
        for name, value in tree_flatten(module.parameters()):
            weights |= {prefix + k: v for k, v in _published(name, _randomised(name, value)).items()}
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    if train:
        train_head(out)


def _write_head(out: Path, head) -> None:
    weights = {k: v for k, v in mx.load(str(out / "model.safetensors")).items() if not k.startswith("mtp.")}
    for name, value in tree_flatten(head.parameters()):
        weights |= {"mtp." + k: v for k, v in _published(name, value).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)


def train_head(out: Path, steps: int = 80, seed: int = 12) -> float:
    """Distil the head on its target's own greedy continuations (fixtures_mtp.distil_head) and write it back in the
    published layout; its accuracy."""
    from .nemotron_h_mtp import load_head

    head, accuracy = distil_head(out, load_head, lambda model: (model.backbone.embeddings, model.lm_head), steps,
                                 seed)
    _write_head(out, head)
    return accuracy
