"""Laguna DFlash drafters (mlx-vlm's `laguna_dflash`), served as the `dflash` kind (issue 42). This module holds what
the config and safetensors headers decide beyond a DFlash drafter's (drafters.dflash.config); its layers are
drafters.dflash.laguna_head.

A checkpoint is one when its `model_type` is `laguna` with a `dflash_config` (mlx-vlm's get_model_type). Keys, as
mlx-vlm's config requires them: dflash_config {block_size, mask_token_id, target_layer_ids, num_target_layers, causal:
true}; `gating: "per-head"`, every layer `sliding_attention` with `sliding_window` W (and `sliding_windows` all W),
one tapped target layer per layer, `draft_vocab_size` the vocabulary, RoPE theta `rope_theta` at the top level
(rope_parameters give only its scaling). What differs from a DFlash drafter:

- each tapped layer's slice of the context features normed by its own `aux_hidden_norms.i` before `fc`;
- one `qkv_proj` [(heads + 2 kv) x D, H] (q, k, v rows in that order; split q/k/v_proj are read alike);
- the attention output scaled per head by softplus(`g_proj` [heads, H] of the layer's normed input), in float32;
- the block causal, and sliding-window attention of W over the positions: a block query sees the W - 1 positions
  before it (the context cache holds the last W - 1). mlx-vlm lets every block query see all W - 1 (and more after a
  multi-token commit); the two agree while the context is shorter than W - k.
"""

from __future__ import annotations

VARIANT = "laguna"
AUX = "aux_hidden_norms."
QKV = "self_attn.qkv_proj.weight"


def add_keys(config: dict, flat: dict) -> None:
    """The window, the causal block, the gate and RoPE, after DFlash's keys (dflash_config's over the top level's)."""
    inner = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if "block_size" in inner:
        flat["block_size"] = inner["block_size"]
    # the window W as declared (checked), and the W - 1 positions before a query it sees: the context window, and
    # the sliding window the books read (a context cache holds that many positions)
    window = flat["declared_window"] = flat.get("sliding_window")
    flat["context_window"] = flat["sliding_window"] = \
        window - 1 if isinstance(window, int) and not isinstance(window, bool) else window
    flat["causal_block"] = flat.pop("causal")
    rope = config.get("rope_parameters")
    flat["rope_theta"] = config.get("rope_theta")  # mlx-vlm's: the top level's, required
    # rope_parameters give the scaling when flat (a table per layer type, as the target's, reads as default RoPE)
    flat_rope = isinstance(rope, dict) and not any(isinstance(v, dict) for v in rope.values())
    flat["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"} if flat_rope else None
    flat["rope_traditional"] = False


def check(flat: dict) -> str | None:
    """Why a Laguna DFlash config drafts otherwise than the node runs it, or None."""
    window, layers = flat["declared_window"], flat["num_hidden_layers"]
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        return f"malformed Laguna DFlash config: sliding_window is {window!r}"
    if flat.get("gating") != "per-head":
        return f"Laguna DFlash gating {flat.get('gating')!r} is not served (only per-head)"
    if flat.get("causal_block") is not True:
        return "a Laguna DFlash drafter's blocks are causal (dflash_config.causal: true)"
    if flat.get("layer_types") != ["sliding_attention"] * layers or \
            (flat.get("sliding_windows") or [window] * layers) != [window] * layers:  # mlx-vlm's default when empty
        return "a Laguna DFlash drafter has sliding_attention layers of one window"
    ids = flat.get("target_layer_ids")
    if not isinstance(ids, list) or len(ids) != layers:
        return f"a Laguna DFlash drafter taps one target layer per layer: {ids!r} for {layers}"
    if flat.get("draft_vocab_size", flat.get("vocab_size")) != flat.get("vocab_size"):
        return "Laguna DFlash drafters with a draft vocabulary of their own are not served"
    if flat.get("qkv_bias"):
        return "Laguna DFlash drafters with qkv biases are not served"
    if flat["num_attention_heads"] % flat["num_key_value_heads"]:
        return "Laguna DFlash attention heads are not a multiple of its KV heads"
    return None


def expected_shapes(flat: dict) -> dict[str, tuple[int, ...]]:
    """Laguna's tensors beyond DFlash's (its q/k/v as DFlash's, split: `split_qkv`)."""
    h = flat["hidden_size"]
    shapes = {f"{AUX}{i}.weight": (h,) for i in range(len(flat["target_layer_ids"]))}
    return shapes | {f"layers.{n}.self_attn.g_proj.weight": (flat["num_attention_heads"], h)
                     for n in range(flat["num_hidden_layers"])}


def split_qkv(flat: dict, tensors: dict) -> dict:
    """Each layer's fused `qkv_proj` as DFlash's q/k/v_proj: on arrays (a load) or on (dtype, shape) headers (a
    check). A fused tensor of the wrong row count is left whole, so the check names it."""
    rows = [flat["num_attention_heads"] * flat["head_dim"]] + [flat["num_key_value_heads"] * flat["head_dim"]] * 2
    out = {}
    for name, value in tensors.items():
        array = hasattr(value, "shape")  # an mx.array, not a header's (dtype, shape): no MLX import to read headers
        shape = tuple(value.shape) if array else tuple(value[1])
        if not name.endswith(QKV) or shape[0] != sum(rows):
            out[name] = value
            continue
        prefix = name[:-len("qkv_proj.weight")]
        for part, lo, n in zip("qkv", (0, rows[0], rows[0] + rows[1]), rows):
            out[f"{prefix}{part}_proj.weight"] = value[lo:lo + n] if array \
                else (value[0], [n, *shape[1:]])
    return out
