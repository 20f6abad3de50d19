"""Gemma 4 DSpark drafters (mlx-vlm's `gemma4_dspark`: Gemma4DSparkDraftModel), served as the `dflash` kind (issue
42). A DSpark drafter (drafters.dflash.dspark: DFlash's block, a Markov correction) whose layers are Gemma 4's; this module
holds what its config and safetensors headers decide beyond a DSpark drafter's, its layers are
drafters.dflash.gemma4_dspark_head.

A checkpoint is one when its architectures name `Gemma4DSparkModel` (mlx-vlm's get_model_type); it declares the
generic `gemma4_text` model type and its DSpark keys flat (or under dflash_config, read alike). What differs from
DSpark's Qwen3 layers, as mlx-vlm runs them: each (full-attention) layer projects to `global_head_dim` with
`num_global_key_value_heads` and, with `attention_k_eq_v`, one projection serves keys and values (no v_proj; the
keys normed, the values not); a unit softmax scale; RoPE from `rope_parameters["full_attention"]` (Gemma 4's
proportional partial rotation; theta 1e4 when none); sandwich norms, a GeGLU MLP and a `layer_scalar` a layer; its
own `embed_tokens` (scaled by sqrt(H)) and untied `lm_head`, and the final softcap (30 when the key is absent).
"""

from __future__ import annotations

VARIANT = "gemma4_dspark"
ARCHITECTURE = "Gemma4DSparkModel"
# mlx-vlm's Gemma4DsparkConfig defaults for the keys that shape the layers
DEFAULTS = {"global_head_dim": 512, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "enable_moe_block": False,
            "use_double_wide_mlp": False, "num_kv_shared_layers": 0}


def is_gemma4_dspark(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def add_keys(config: dict, flat: dict) -> None:
    """The Gemma 4 keys into `flat`, after DFlash's and DSpark's: the attention geometry of its full-attention layers
    as the generic books read it (head_dim, KV heads), the RoPE of that layer type, the unit scale."""
    for key, default in DEFAULTS.items():
        flat[key] = config.get(key, default)
    # Gemma 4's keys renamed: the books read the flat config as a Qwen3 one, whose every layer caches K and V (this
    # drafter's too: the keys normed, the values not), each of head_dim with num_key_value_heads heads
    global_dim, global_kv = flat.pop("global_head_dim"), flat.pop("num_global_key_value_heads")
    flat["keys_as_values"] = flat.pop("attention_k_eq_v")
    if global_dim:
        flat["head_dim"] = global_dim
    if flat["keys_as_values"] and global_kv is not None:
        flat["num_key_value_heads"] = global_kv
    parameters = config.get("rope_parameters")
    full = (parameters.get("full_attention") or {}) if isinstance(parameters, dict) else {}
    rope = dict(full) if isinstance(full, dict) else None
    flat["rope_theta"] = rope.pop("rope_theta", 10000.0) if rope is not None else None
    flat["rope_scaling"] = rope
    flat["rope_traditional"] = bool(config.get("rope_traditional", False))
    flat["attention_scale"] = 1.0
    flat["hidden_act"] = flat["hidden_activation"]


def check(flat: dict) -> str | None:
    """Why a Gemma 4 DSpark config drafts otherwise than the node runs it, or None."""
    if flat["rope_scaling"] is None:
        return "malformed Gemma 4 DSpark config: rope_parameters.full_attention is not a table"
    if flat["rope_scaling"].get("rope_type", "default") not in ("default", "proportional"):
        return f"Gemma 4 DSpark RoPE type {flat['rope_scaling'].get('rope_type')!r} is not served"
    if flat["hidden_activation"] != "gelu_pytorch_tanh":
        return f"Gemma 4 DSpark hidden_activation {flat['hidden_activation']!r} is not served (only gelu_pytorch_tanh)"
    if flat["enable_moe_block"] or (flat["use_double_wide_mlp"] and flat["num_kv_shared_layers"]):
        return "Gemma 4 DSpark drafters with MoE or double-wide MLP layers are not served"
    for key in ("head_dim", "num_key_value_heads"):
        value = flat[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"malformed Gemma 4 DSpark config: {key} is {value!r}"
    cap = flat["final_logit_softcapping"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf")):
        return f"malformed Gemma 4 DSpark config: final_logit_softcapping is {cap!r}"
    return None


def expected_shapes(flat: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the drafter (named without a `model.` prefix) but DSpark's Markov and confidence heads."""
    h, i, d, v = flat["hidden_size"], flat["intermediate_size"], flat["head_dim"], flat["vocab_size"]
    heads, kv = flat["num_attention_heads"], flat["num_key_value_heads"]
    shapes = {"fc.weight": (h, len(flat["target_layer_ids"]) * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
              "embed_tokens.weight": (v, h), "lm_head.weight": (v, h)}
    for n in range(flat["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes |= {p + name + ".weight": (h,) for name in ("input_layernorm", "post_attention_layernorm",
                                                          "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        shapes |= {p + "layer_scalar": (1,), p + "self_attn.q_proj.weight": (heads * d, h),
                   p + "self_attn.k_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if not flat["keys_as_values"]:
            shapes[p + "self_attn.v_proj.weight"] = (kv * d, h)
    return shapes
