"""MuseGlimmer DFlash assistants (mlx-vlm's `muse_glimmer_assistant`: Meta's drafter for Muse Glimmer targets), served
as the `dflash` kind (issue 42). This module holds what its config and safetensors headers decide beyond a DFlash
drafter's (drafters.dflash.config); its model is DFlashHead with a context window (drafters.dflash.head).

A checkpoint is one when its `model_type` is `muse_glimmer_assistant`. Its DFlash keys sit at the top level (or under
dflash_config: block_size, mask_token_id, target_layer_ids), with mlx-vlm's defaults (the published 30B assistant's:
mask 201818, layers [1, 13, 25, 37, 49] of 52). What differs from a DFlash drafter, as mlx-vlm reads and runs it:

- one tapped target layer per drafter layer, every layer `sliding_attention`;
- the context projection named `encoder.fc` and `encoder.output_norm_enc` (DFlash's `fc` and `hidden_norm`);
- each block query sees the context positions within `sliding_window` of it (transformers' |q - k| <= window, not
  causal), so the context cache holds the last `sliding_window` positions;
- RoPE from `rope_parameters` (theta 5e5 when none), never traditional;
- the block embedded by the target's raw embedding table (the target itself RMS-normalises its embeddings) and read by
  the target's LM head; mlx-vlm leaves out the target's output multiplier and softcap, the node applies them (the
  same greedy drafts; sampled drafts drawn from a q as sharp as the target's p).
"""

from __future__ import annotations

MODEL_TYPE = "muse_glimmer_assistant"
VARIANT = "muse_glimmer"
DEFAULT_ROPE_THETA = 500_000.0
# mlx-vlm's MuseGlimmerAssistantConfig defaults for the keys a config may leave out
DEFAULTS = {"mask_token_id": 201818, "target_layer_ids": [1, 13, 25, 37, 49], "num_target_layers": 52,
            "block_size": 16, "sliding_window": 2048, "num_hidden_layers": 5}
NAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}  # as DFlash's head names them


def is_muse_glimmer(config: dict) -> bool:
    return config.get("model_type") == MODEL_TYPE


def add_keys(config: dict, flat: dict) -> None:
    """mlx-vlm's defaults for what the config leaves out, the window and RoPE, after DFlash's keys."""
    inner = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if "block_size" in inner:
        flat["block_size"] = inner["block_size"]
    for key, default in DEFAULTS.items():
        flat.setdefault(key, default)
    flat.setdefault("layer_types", ["sliding_attention"] * flat["num_hidden_layers"]
                    if isinstance(flat["num_hidden_layers"], int) else [])
    flat["context_window"] = flat["sliding_window"]
    flat["target_logits"] = True  # read through the target's output multiplier and softcap (DFlashHead.embedding)
    rope = config.get("rope_parameters")
    rope = dict(rope) if isinstance(rope, dict) else {"rope_type": "default"}
    flat["rope_theta"] = rope.pop("rope_theta", DEFAULT_ROPE_THETA)
    flat["rope_scaling"] = rope
    flat["rope_traditional"] = False


def check(flat: dict) -> str | None:
    """Why a MuseGlimmer assistant's config drafts otherwise than the node runs it, or None."""
    window = flat["context_window"]
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return f"malformed MuseGlimmer assistant config: sliding_window is {window!r}"
    if flat.get("layer_types") != ["sliding_attention"] * flat["num_hidden_layers"]:
        return "a MuseGlimmer assistant has one sliding_attention layer type per layer"
    ids = flat.get("target_layer_ids")
    if not isinstance(ids, list) or len(ids) != flat["num_hidden_layers"]:
        return f"a MuseGlimmer assistant taps one target layer per layer: {ids!r} for {flat['num_hidden_layers']}"
    if flat["num_attention_heads"] % flat["num_key_value_heads"]:
        return "MuseGlimmer attention heads are not a multiple of its KV heads"
    return None


def canonical(name: str) -> str:
    """A tensor's name as DFlash's head names it (`model.` already removed)."""
    return next((name.replace(a, b, 1) for a, b in NAMES.items() if name.startswith(a)), name)
