"""EAGLE-3 drafter checkpoints: a drafter of its own, trained against one target, that reads three of the target's
decoder layers (issue 42). Detected, paired and refused here from config files and safetensors headers (and the
drafter's small d2t index table); the model itself is drafters.eagle3.head.

Two published layouts, read alike:

- flat (yuhuili/EAGLE3-*, AngelSlim/*_eagle3, lmsys): a Llama config with `architectures` such as
  LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM, `draft_vocab_size`, optionally `eagle_config`
  {eagle_aux_hidden_state_layer_ids}; tensors `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`;
- Speculators (`speculators_model_type: eagle3`): the layer's config nested in `transformer_layer_config`, the
  layer's tensors as `layers.0.*`.

The capture ids are the target's layer indices whose *input* the drafter reads (vLLM's and SGLang's aux hidden
states: the output of layer id - 1), by default (2, n // 2, n - 3) of the target's n layers, as vLLM takes them.
"""

from __future__ import annotations

import struct
from pathlib import Path

from ...memory.estimate import text_config
from ...memory.checkpoint import HeaderError, open_checkpoint, read_safetensors_header

EAGLE3 = "eagle3"  # what a Speculators config or a model type calls it
LAYER_PREFIXES = ("midlayer.", "layers.0.")
_INT_DTYPES = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "U8": "<u1", "U16": "<u2", "U32": "<u4", "U64": "<u8"}


def is_eagle3(config: dict) -> bool:
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    return (any("eagle3" in str(a).lower() for a in archs) or config.get("speculators_model_type") == EAGLE3
            or config.get("model_type") == EAGLE3 or isinstance(config.get("eagle_config"), dict))


def flat_config(config: dict) -> dict:
    """The drafter's layer as a flat Llama config (mlx-lm's llama.ModelArgs reads it; memory.estimate books it),
    with the EAGLE-3 keys beside it: draft_vocab_size, target_hidden_size, norm_before_residual, layer_ids."""
    nested = config.get("transformer_layer_config")
    flat = dict(nested) if isinstance(nested, dict) else dict(config)
    flat.pop("architectures", None)
    flat["model_type"] = "llama"
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    ids = (config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
           or config.get("target_layer_ids"))
    flat["layer_ids"] = list(ids) if isinstance(ids, list) else None
    flat["draft_vocab_size"] = config.get("draft_vocab_size") or flat.get("vocab_size")
    flat["target_hidden_size"] = config.get("target_hidden_size") or flat.get("hidden_size")
    flat["norm_before_residual"] = bool(config.get("norm_before_residual", False))
    return flat


def capture_ids(flat: dict, target_layers: int) -> list[int]:
    """The target layer ids the drafter reads, ascending (the order vLLM concatenates them in)."""
    ids = flat["layer_ids"] if flat.get("layer_ids") is not None else \
        [2, target_layers // 2, target_layers - 3]
    return sorted(ids) if all(isinstance(i, int) for i in ids) else list(ids)


def tapped_layers(flat: dict, target_layers: int) -> list[int]:
    """The target's decoder layers whose outputs the drafter reads (id - 1 for each capture id)."""
    return [i - 1 for i in capture_ids(flat, target_layers)]


def _ints(flat: dict, *keys: str) -> str | None:
    for key in keys:
        if not isinstance(flat.get(key), int) or isinstance(flat.get(key), bool) or flat[key] <= 0:
            return f"malformed EAGLE-3 config: {key} is {flat.get(key)!r}"
    return None


def expected_shapes(flat: dict) -> dict[str, tuple[int, ...]]:
    """The drafter's tensors and their shapes, the layer's named without its prefix (`LAYER_PREFIXES`)."""
    h, th, i = flat["hidden_size"], flat["target_hidden_size"], flat["intermediate_size"]
    heads, kv = flat["num_attention_heads"], flat.get("num_key_value_heads") or flat["num_attention_heads"]
    d = flat.get("head_dim") or h // heads
    shapes = {"fc.weight": (h, 3 * th), "norm.weight": (h,), "lm_head.weight": (flat["draft_vocab_size"], h),
              "layer.input_layernorm.weight": (h,), "layer.hidden_norm.weight": (h,),
              "layer.post_attention_layernorm.weight": (h,),
              "layer.self_attn.q_proj.weight": (heads * d, 2 * h), "layer.self_attn.k_proj.weight": (kv * d, 2 * h),
              "layer.self_attn.v_proj.weight": (kv * d, 2 * h), "layer.self_attn.o_proj.weight": (h, heads * d),
              "layer.mlp.gate_proj.weight": (i, h), "layer.mlp.up_proj.weight": (i, h),
              "layer.mlp.down_proj.weight": (h, i)}
    if flat["draft_vocab_size"] != flat["vocab_size"]:
        shapes["d2t"] = (flat["draft_vocab_size"],)
    return shapes


def canonical(name: str) -> str:
    """A checkpoint tensor's name as `expected_shapes` names it."""
    for prefix in LAYER_PREFIXES:
        if name.startswith(prefix):
            return "layer." + name[len(prefix):]
    return name


def check_pair(target_config: dict, drafter: Path, config: dict) -> str:
    """"ok", or why the EAGLE-3 drafter at `drafter` cannot draft for the target of `target_config`."""
    tc = text_config(target_config)
    flat = flat_config(config)
    bad = _ints(flat, "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_vocab_size",
                "target_hidden_size", "num_hidden_layers")
    if bad:
        return bad
    if flat["num_hidden_layers"] != 1:
        return f"EAGLE-3 drafters of {flat['num_hidden_layers']} layers are not served (the published ones have 1)"
    if flat["target_hidden_size"] != tc.get("hidden_size"):
        return f"EAGLE-3 target_hidden_size {flat['target_hidden_size']} != target hidden_size {tc.get('hidden_size')}"
    if flat["vocab_size"] != tc.get("vocab_size"):
        return f"EAGLE-3 vocab_size {flat['vocab_size']} != target vocab_size {tc.get('vocab_size')}"
    if flat["draft_vocab_size"] > flat["vocab_size"]:
        return f"EAGLE-3 draft_vocab_size {flat['draft_vocab_size']} > vocab_size {flat['vocab_size']}"
    n = tc.get("num_hidden_layers") or 0
    ids = capture_ids(flat, n)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(isinstance(i, int) and 1 <= i < n for i in ids):
        return f"EAGLE-3 capture layer ids {ids} are not 3 distinct layers in 1..{n - 1} of the target"
    try:
        tensors = {canonical(k): v for k, v in open_checkpoint(drafter).tensors.items()}
    except (HeaderError, OSError) as e:
        return f"EAGLE-3 drafter weights are unreadable: {e}"
    for name, shape in expected_shapes(flat).items():
        if name not in tensors:
            return f"EAGLE-3 drafter has no tensor {name}"
        if tuple(tensors[name][1]) != shape:
            return f"EAGLE-3 tensor {name} is {list(tensors[name][1])}, expected {list(shape)}"
    known = set(expected_shapes(flat)) | {"d2t", "t2d", "embed_tokens.weight"}
    extra = sorted(n for n in tensors if n not in known and "rotary_emb" not in n and not n.startswith("verifier_"))
    if extra:  # a quantized drafter (scales, biases), norm_before_fc's input_norm, ...: its load would refuse them
        return f"EAGLE-3 drafter has tensors the node does not load: {', '.join(extra[:3])}"
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed[1]) != (flat["vocab_size"], flat["hidden_size"]):
        return f"EAGLE-3 tensor embed_tokens.weight is {list(embed[1])}"
    if embed is None and flat["hidden_size"] != tc.get("hidden_size"):
        return "EAGLE-3 drafter ships no embedding and its hidden size is not the target's"
    if "d2t" in tensors:
        return _check_d2t(drafter, tensors["d2t"][0], flat)
    return "ok"


def _check_d2t(drafter: Path, dtype: str, flat: dict) -> str:
    """Every draft id maps to a distinct target id in range (the scatter of the draft distribution needs both)."""
    import numpy as np

    if dtype not in _INT_DTYPES:
        return f"EAGLE-3 d2t has dtype {dtype}, not an integer one"
    try:
        d2t = read_tensor(drafter, "d2t", _INT_DTYPES[dtype])
    except (OSError, ValueError, KeyError, TypeError, HeaderError) as e:
        return f"EAGLE-3 d2t is unreadable: {e}"
    hot = np.arange(d2t.shape[0]) + d2t.astype(np.int64)
    if hot.min(initial=0) < 0 or hot.max(initial=0) >= flat["vocab_size"]:
        return f"EAGLE-3 d2t maps draft ids outside the target's vocabulary of {flat['vocab_size']}"
    if len(np.unique(hot)) != len(hot):
        return "EAGLE-3 d2t maps two draft ids to one target id"
    return "ok"


def read_tensor(drafter: Path, name: str, dtype: str):
    """One small tensor of a safetensors file, read by its header's offsets (numpy, 1-D): a header checked as
    every header the node reads is (checkpoint.read_safetensors_header), and offsets that span its shape exactly."""
    import math

    import numpy as np

    for f in sorted(drafter.glob("*.safetensors")):
        header = read_safetensors_header(f)
        if name in header:
            start, end = header[name]["data_offsets"]
            if end - start != math.prod(header[name]["shape"]) * np.dtype(dtype).itemsize:
                raise ValueError(f"{name}'s offsets do not span its shape")
            with open(f, "rb") as fh:
                fh.seek(8 + struct.unpack("<Q", fh.read(8))[0] + start)
                return np.frombuffer(fh.read(end - start), dtype=dtype)
    raise KeyError(name)


def weight_bytes(drafter: Path) -> int:
    """What the drafter holds loaded (drafters.eagle3.head): every tensor but t2d, d2t as the int32 target ids."""
    import math

    from ...memory.estimate import DTYPE_BYTES

    checkpoint = open_checkpoint(drafter)
    flat = flat_config(checkpoint.config)
    maps = flat["draft_vocab_size"] != flat["vocab_size"]  # else a shipped d2t is not loaded
    total = 0
    for name, (dtype, shape) in checkpoint.tensors.items():
        if name == "t2d" or "rotary_emb" in name or name.startswith("verifier_") or (name == "d2t" and not maps):
            continue
        total += (4 if name == "d2t" else DTYPE_BYTES.get(dtype, 4)) * math.prod(shape)
    return total
