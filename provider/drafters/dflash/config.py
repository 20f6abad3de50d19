"""DFlash drafter checkpoints (z-lab's Qwen3-*-DFlash): a block-diffusion drafter of its own, trained against one
target, that reads several of the target's decoder layers (issue 42). Detected, paired and refused here from config
files and safetensors headers; the model itself is drafters.dflash.head, its rounds engine.dflash_drafter.

The published layout: a Qwen3-like config with `architectures: [DFlashDraftModel]`, `block_size` (the trained
block: the bonus token and block_size - 1 mask tokens), `dflash_config` {mask_token_id, target_layer_ids}
(mlx-vlm also reads them at the top level) and `num_target_layers`; tensors `fc` [H, n * H] over the n tapped
layers' outputs concatenated, `hidden_norm`, `layers.i.*` (Qwen3 attention with q/k norms, MLP) and `norm`, with
or without a `model.` prefix; no embedding and no LM head (the target's are used).

The target layer ids are the target's decoder layers whose *outputs* the drafter reads (z-lab's
hidden_states[id + 1], mlx-vlm's capture_layer_ids). mlx-vlm's DSpark (a low-rank Markov correction that makes
each block position's logits depend on the previous draft, and a confidence head) is served as this kind
(drafters.dflash.dspark holds its own checks), and so are DFlash2 (grouped dynamic causal convolutions around each layer's
attention and MLP, and a candidate selector: drafters.dflash.dflash2), Gemma 4 DSpark (drafters.dflash.gemma4_dspark), MuseGlimmer's
assistant (a context window: drafters.dflash.muse_glimmer) and Laguna's DFlash (a window, a causal block, gated
heads: drafters.dflash.laguna).
"""

from __future__ import annotations

import math
from pathlib import Path

from ...memory.estimate import DTYPE_BYTES, text_config
from . import dflash2
from . import dspark
from . import gemma4_dspark
from . import laguna
from . import muse_glimmer as muse
from ...memory.checkpoint import HeaderError, open_checkpoint

DFLASH = "dflash"  # Capabilities.speculates_with
# mlx-vlm's other block drafters (DSpark last: Gemma4DSparkModel is a Gemma 4 one)
_VARIANTS = ("dflash2", "laguna", "gemma4", "dspark", "muse_glimmer")
GEMMA4_MASK = 4  # mlx-vlm's Gemma4DFlashConfig default mask_token_id


DEFAULT_ROPE_THETA = 10_000_000.0  # mlx-vlm's DFlashConfig default (z-lab's Qwen3 drafters)


def is_dflash(config: dict) -> bool:
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    return (any("dflash" in str(a).lower() or "dspark" in str(a).lower() for a in archs)
            or isinstance(config.get("dflash_config"), dict)
            or config.get("model_type") in ("dspark", "dflash2", "muse_glimmer_assistant"))


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
    flat["variant"] = next((v for v in _VARIANTS if v in str(config.get("model_type", "")).lower()
                            or any(v in str(a).lower() for a in config.get("architectures") or [])), None)
    if flat["variant"] in (None, "dspark") and dspark.is_dspark(config):  # also a projector_type or a markov_rank
        flat["variant"] = "dspark"
        dspark.add_keys(config, flat)
    if flat["variant"] == dflash2.VARIANT:
        dflash2.add_keys(config, flat)
    if flat["variant"] == "gemma4" and gemma4_dspark.is_gemma4_dspark(config):
        flat["variant"] = gemma4_dspark.VARIANT  # a DSpark drafter with Gemma 4's layers (drafters.dflash.gemma4_dspark)
        dspark.add_keys(config, flat)
    elif flat["variant"] == "gemma4":
        flat["variant"] = "gemma4_dflash"  # mlx-vlm's gemma4_dflash: a DFlash drafter, the mask token 4 by default
        flat.setdefault("mask_token_id", GEMMA4_MASK)
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
    if flat["variant"] == gemma4_dspark.VARIANT:  # its RoPE per layer type, its full-attention layers' geometry
        gemma4_dspark.add_keys(config, flat)
    if flat["variant"] == muse.VARIANT:  # mlx-vlm's defaults, its context window, its RoPE
        muse.add_keys(config, flat)
    if flat["variant"] == laguna.VARIANT:  # its window, causal block, gate and RoPE
        laguna.add_keys(config, flat)
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
    """The drafter's tensors (named without a `model.` prefix) and their shapes."""
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
    if flat.get("variant") == gemma4_dspark.VARIANT:  # Gemma 4's layers in place of Qwen3's
        shapes = gemma4_dspark.expected_shapes(flat)
    extra = {dflash2.VARIANT: dflash2.expected_shapes, laguna.VARIANT: laguna.expected_shapes} | \
        dict.fromkeys(dspark.VARIANTS, dspark.expected_shapes)
    return shapes | (extra[flat["variant"]](flat) if flat.get("variant") in extra else {})


def canonical(name: str) -> str:
    return muse.canonical(dflash2.canonical(name.removeprefix("model.")))


def canonical_tensors(flat: dict, tensors: dict) -> dict:
    """The drafter's tensors (arrays, or headers' (dtype, shape)) under DFlash's head's names, a Laguna drafter's
    fused q/k/v split."""
    named = {canonical(k): v for k, v in tensors.items()}
    return laguna.split_qkv(flat, named) if flat.get("variant") == laguna.VARIANT else named


def _served(flat: dict) -> str | None:
    """Why a well-formed config drafts otherwise than the rounds the node runs, or None."""
    checks = {"dspark": [dspark.check], gemma4_dspark.VARIANT: [dspark.check, gemma4_dspark.check],
              dflash2.VARIANT: [dflash2.check], muse.VARIANT: [muse.check],
              laguna.VARIANT: [laguna.check]}.get(flat["variant"], [])
    why = next((why for why in (check(flat) for check in checks) if why), None)
    if why:
        return why
    if flat["variant"] not in (None, "dspark", "gemma4_dflash", gemma4_dspark.VARIANT, dflash2.VARIANT, muse.VARIANT,
                               laguna.VARIANT):
        return f"DFlash variant {flat['variant']} is not served"
    if flat.get("causal") or flat.get("attention_sink_bias") or flat.get("draft_window_size"):
        return "DFlash drafters with causal blocks, attention sinks or a draft window are not served"
    windowed = flat["variant"] in (muse.VARIANT, laguna.VARIANT)  # their sliding layers: drafters.dflash.head's window
    if not windowed and any(t != "full_attention" for t in flat.get("layer_types") or []):
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
    bad = _ints(flat, "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "num_hidden_layers", "block_size")
    if bad:
        return bad
    why = _served(flat)
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
    if flat["variant"] in ("gemma4_dflash", gemma4_dspark.VARIANT) and not gemma4:
        return f"a Gemma 4 drafter ({flat['variant']}) does not draft for {tc.get('model_type')} targets"
    for variant, family in ((muse.VARIANT, "muse_glimmer"), (laguna.VARIANT, "laguna")):
        if flat["variant"] == variant and not str(tc.get("model_type", "")).startswith(family):
            return f"a {family} drafter does not draft for {tc.get('model_type')} targets"
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
    if flat["block_size"] < 2 and flat["variant"] not in dspark.VARIANTS:  # DSpark's counts proposals: dspark.check
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
    return "rotary_emb" not in name and not canonical(name).startswith(dspark.CONFIDENCE)
