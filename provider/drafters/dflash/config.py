"""DFlash drafter checkpoints (z-lab's Qwen3-*-DFlash): a block-diffusion drafter of its own, trained against one
target, that reads several of the target's decoder layers (issue 42). Detected, paired and refused here from config
files and safetensors headers; the model itself is drafters.dflash.head, its rounds engine.dflash_drafter.

The published layout: a Qwen3-like config with `architectures: [DFlashDraftModel]`, `block_size` (the trained
block: the bonus token and block_size - 1 mask tokens), `dflash_config` {mask_token_id, target_layer_ids}
(mlx-vlm also reads them at the top level) and `num_target_layers`; tensors `fc` [H, n * H] over the n tapped
layers' outputs concatenated, `hidden_norm`, `layers.i.*` (Qwen3 attention with q/k norms, MLP) and `norm`, with
or without a `model.` prefix; no embedding and no LM head (the target's are used).

The target layer ids are the target's decoder layers whose *outputs* the drafter reads (z-lab's
hidden_states[id + 1], mlx-vlm's capture_layer_ids). mlx-vlm's other block drafters are served as this kind, each a
row of drafters.dflash.variants (how it is recognised, its keys, checks, tensors, target family and head class):
DSpark (a low-rank Markov correction), DFlash2 (grouped dynamic causal convolutions and a candidate selector),
Gemma 4's DFlash and DSpark drafters, MuseGlimmer's assistant (a context window) and Laguna's DFlash (a window, a
causal block, gated heads). Nothing here names a variant: what differs is the row's.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...memory.checkpoint import HeaderError, open_checkpoint
from ...memory.estimate import DTYPE_BYTES, text_config
from .dspark import CONFIDENCE
from .variants import BY_NAME, Variant, variant_of

DEFAULT_ROPE_THETA = 10_000_000.0  # mlx-vlm's DFlashConfig default (z-lab's Qwen3 drafters)


def is_dflash(config: dict) -> bool:
    """A DFlash drafter of some variant: a DFlash or DSpark architecture, a dflash_config, or a model type only a
    variant's checkpoints declare (its row's `model_types`)."""
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    return (any("dflash" in str(a).lower() or "dspark" in str(a).lower() for a in archs)
            or isinstance(config.get("dflash_config"), dict)
            or any(config.get("model_type") in v.model_types for v in BY_NAME.values()))


def flat_config(config: dict) -> dict:
    """The drafter's config with the DFlash keys at the top level (as mlx-vlm's DFlashConfig.from_dict reads them);
    `model_type` qwen3, so memory.estimate books its layers."""
    flat = dict(config)
    inner = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    for key in ("mask_token_id", "target_layer_ids", "num_target_layers", "runtime_block_size", "draft_window_size",
                "attention_sink_bias"):
        if key in inner:
            flat[key] = inner[key]
    flat["causal"] = bool(inner.get("causal", config.get("dflash_query_causal", False)))
    variant = variant_of(config)
    flat["variant"], flat["markov"] = variant.name, variant.markov
    # RoPE as mlx-vlm's DFlashConfig reads it: rope_parameters carry the theta and the scaling, the theta is 1e7
    # when none is given (not mlx-lm's 1e4), and the pairing is NeoX unless rope_is_neox_style says otherwise.
    if isinstance(config.get("rope_parameters"), dict):
        rope = dict(config["rope_parameters"])
        flat["rope_theta"] = rope.pop("rope_theta", flat.get("rope_theta"))
        flat["rope_scaling"] = rope
    flat.pop("rope_parameters", None)
    if flat.get("rope_theta") is None:
        flat["rope_theta"] = DEFAULT_ROPE_THETA
    flat["rope_traditional"] = not bool(config.get("rope_is_neox_style", True))
    for add_keys in variant.keys:  # after DFlash's: a variant's RoPE, window or layer geometry overrides them
        add_keys(config, flat)
    flat["model_type"] = "qwen3"
    flat.setdefault("head_dim", (flat.get("hidden_size") or 0) // max(1, flat.get("num_attention_heads") or 1))
    flat.setdefault("num_key_value_heads", flat.get("num_attention_heads"))
    flat.setdefault("block_size", 16)
    return flat


def _ints(flat: dict, *keys: str) -> str | None:
    for key in keys:
        if not isinstance(flat.get(key), int) or isinstance(flat.get(key), bool) or flat[key] <= 0:
            return f"malformed DFlash config: {key} is {flat.get(key)!r}"
    return None


def expected_shapes(flat: dict) -> dict[str, tuple[int, ...]]:
    """The drafter's tensors (named without a `model.` prefix) and their shapes: its variant's layers (Qwen3's
    unless its row says otherwise) and what its row adds."""
    variant = BY_NAME[flat["variant"]]
    shapes = variant.layers(flat) if variant.layers else _qwen3_layers(flat)
    return shapes | (variant.extra(flat) if variant.extra else {})


def _qwen3_layers(flat: dict) -> dict[str, tuple[int, ...]]:
    h, i, d = flat["hidden_size"], flat["intermediate_size"], flat["head_dim"]
    heads, kv = flat["num_attention_heads"], flat["num_key_value_heads"]
    shapes = {"fc.weight": (h, len(flat["target_layer_ids"]) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(flat["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                   p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return shapes


def canonical_tensors(flat: dict, tensors: dict) -> dict:
    """The drafter's tensors (arrays, or headers' (dtype, shape)) under DFlash's head's names: without a `model.`
    prefix, renamed and split as its variant's row says (MuseGlimmer's encoder names, Laguna's fused q/k/v)."""
    variant = BY_NAME[flat["variant"]]
    rename = variant.rename or (lambda name: name)
    named = {rename(k.removeprefix("model.")): v for k, v in tensors.items()}
    return variant.split(flat, named) if variant.split else named


def _served(flat: dict, variant: Variant) -> str | None:
    """Why a well-formed config drafts otherwise than the rounds the node runs, or None."""
    why = next((why for why in (check(flat) for check in variant.checks) if why), None)
    if why:
        return why
    if flat.get("causal") or flat.get("attention_sink_bias") or flat.get("draft_window_size"):
        return "DFlash drafters with causal blocks, attention sinks or a draft window are not served"
    if not variant.windowed and any(t != "full_attention" for t in flat.get("layer_types") or []):
        return "DFlash drafters with sliding-window layers are not served"
    if flat.get("attention_bias"):
        return "DFlash drafters with attention biases are not served"
    return None


def _rope_error(flat: dict) -> str | None:
    """Why the drafter's RoPE cannot be built (a type mlx-lm has not, a scaling without its keys), or None: refused
    here rather than at its load."""
    from mlx_lm.models.rope_utils import initialize_rope

    try:
        initialize_rope(flat["head_dim"], flat["rope_theta"], flat.get("rope_traditional", False),
                        flat.get("rope_scaling"), flat.get("max_position_embeddings", 32768))
    except (KeyError, ValueError, TypeError, ZeroDivisionError, AttributeError) as e:
        return f"malformed DFlash RoPE scaling {flat.get('rope_scaling')!r}: {e!r}"
    return None


def check_pair(target_config: dict, drafter: Path, config: dict) -> str:
    """"ok", or why the DFlash drafter at `drafter` cannot draft for the target of `target_config`."""
    tc = text_config(target_config)
    flat = flat_config(config)
    variant = BY_NAME[flat["variant"]]
    bad = _ints(flat, "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "num_hidden_layers", "block_size")
    if bad:
        return bad
    why = _served(flat, variant)
    if why:
        return why
    theta = flat["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        return f"malformed DFlash config: rope_theta is {theta!r}"
    why = _rope_error(flat)
    if why:
        return why
    gemma4 = str(tc.get("model_type", "")).startswith("gemma4")
    if str(tc.get("model_type", "")).startswith("gemma") and not gemma4:
        # Gemma 4 scales its embedding by sqrt(H) as a Python float (the drafter's embedding does it alike:
        # drafters.dflash.head.target_embedding); Gemma 3 rounds the scale to bfloat16 first: not matched here
        return f"DFlash drafters for {tc.get('model_type')} targets are not served"
    if variant.target and not str(tc.get("model_type", "")).startswith(variant.target):
        return f"{variant.called} does not draft for {tc.get('model_type')} targets"
    if flat["hidden_size"] != tc.get("hidden_size"):
        return f"DFlash hidden_size {flat['hidden_size']} != target hidden_size {tc.get('hidden_size')}"
    if flat["vocab_size"] != tc.get("vocab_size"):
        return f"DFlash vocab_size {flat['vocab_size']} != target vocab_size {tc.get('vocab_size')}"
    n = tc.get("num_hidden_layers") or 0
    ids = flat.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or len(set(map(str, ids))) != len(ids) or \
            not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in ids) or ids != sorted(ids):
        # ascending, as published: the layer tap concatenates the layers' outputs in layer order
        return f"DFlash target layer ids {ids!r} are not ascending distinct layers in 0..{n - 1} of the target"
    if flat.get("num_target_layers") not in (None, n):
        return f"DFlash num_target_layers {flat['num_target_layers']} != the target's {n} layers"
    mask = flat.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < flat["vocab_size"]:
        return f"DFlash mask_token_id {mask!r} is not a token of the vocabulary"
    if flat["block_size"] < 2 and not variant.markov:  # DSpark's counts proposals: dspark.check_block
        return f"DFlash block_size {flat['block_size']} drafts nothing"
    try:
        tensors = canonical_tensors(flat, open_checkpoint(drafter).tensors)
    except (HeaderError, OSError) as e:
        return f"DFlash drafter weights are unreadable: {e}"
    expected = expected_shapes(flat)
    for name, shape in expected.items():
        if name not in tensors:
            return f"DFlash drafter has no tensor {name}"
        if tuple(tensors[name][1]) != shape:
            return f"DFlash tensor {name} is {list(tensors[name][1])}, expected {list(shape)}"
        if tensors[name][0] not in ("F32", "F16", "BF16"):
            return f"DFlash tensor {name} has dtype {tensors[name][0]}: a quantized drafter is not served"
    extra = sorted(n for n in tensors if n not in expected and "rotary_emb" not in n)
    if extra:  # a quantized drafter's scales and biases, a shipped embedding or LM head: its load would refuse them
        return f"DFlash drafter has tensors the node does not load: {', '.join(extra[:3])}"
    return "ok"


def weight_bytes(drafter: Path) -> int:
    """What the drafter holds loaded (drafters.dflash.head): every tensor but rotary tables and a DSpark confidence
    head (never loaded)."""
    return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(shape) for name, (dtype, shape)
               in open_checkpoint(drafter).tensors.items() if loaded(name))


def loaded(name: str) -> bool:
    """Whether the drafter's load keeps the tensor `name`."""
    return "rotary_emb" not in name and not name.removeprefix("model.").startswith(CONFIDENCE)
