"""DSpark drafters (mlx-vlm's `dspark` / `qwen3_dspark`): a DFlash block drafter (drafters.dflash.config) plus a low-rank
Markov correction of its logits, served as the `dflash` kind (issue 42). This module holds what the config and the
safetensors headers decide beyond a DFlash drafter's; the correction itself is drafters.dflash.dspark_head.

A checkpoint is DSpark (as mlx-vlm's get_model_type decides it) when `dflash_config.projector_type` is "dspark", a
`markov_rank` is given (top level or in dflash_config), or an architecture / model type names DSpark. Its extra
tensors: `markov_head.markov_w1.weight` [V, r] (an embedding of the previous token) and `markov_head.markov_w2.weight`
[V, r] (a linear r -> V); block position i's logits are base_i + w2(w1[previous token]), the previous token being
the anchor (the last committed token) for the first position and the previous draft after it. With
`enable_confidence_head`, `confidence_head.proj` [1, H (+ r)] and its bias predict how far a block will be accepted
(mlx-vlm's adaptive block size): checked here and then ignored (never loaded), since the node picks k itself.

`sample_from_anchor` (mlx-vlm's default true): the block is [anchor, mask x (k - 1)] and its k positions give the k
draft logits (the anchor's position drafts the first); false: [anchor, mask x k] and positions 1..k, as DFlash.
The checkpoint's `block_size` counts proposals (upstream's gamma) unless `dspark_bonus_anchor` says it counts the
anchor too.
"""

from __future__ import annotations

MARKOV = "markov_head."
CONFIDENCE = "confidence_head."  # read from headers and checked, never loaded


def is_dspark(config: dict) -> bool:
    inner = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    names = [str(a).lower() for a in config.get("architectures") or []] + [str(config.get("model_type", "")).lower()]
    rank = inner.get("markov_rank", config.get("markov_rank"))
    return (inner.get("projector_type") == "dspark" or (isinstance(rank, int) and rank > 0)
            or any("dspark" in n for n in names))


def add_keys(config: dict, flat: dict) -> None:
    """The DSpark keys of `config` (its dflash_config's over its top level's, as mlx-vlm reads them) into `flat`."""
    inner = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    for key, default in (("markov_rank", 256), ("markov_head_type", "vanilla"), ("enable_confidence_head", False),
                         ("confidence_head_with_markov", True), ("sample_from_anchor", True),
                         ("projector_type", None)):
        flat[key] = inner.get(key, config.get(key, default))
    raw = inner.get("block_size", config.get("block_size"))
    bonus_anchor = bool(config.get("dspark_bonus_anchor", False))
    flat["proposal_length"] = raw - 1 if bonus_anchor and isinstance(raw, int) else raw


def check(flat: dict) -> str | None:
    """Why a DSpark config's Markov correction is not what the node runs, or None."""
    rank = flat["markov_rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return f"malformed DSpark config: markov_rank is {rank!r}"
    if flat["markov_head_type"] != "vanilla":
        return f"DSpark markov_head_type {flat['markov_head_type']!r} is not served (only vanilla)"
    if flat["projector_type"] not in (None, "dspark"):
        return f"DSpark projector_type {flat['projector_type']!r} is not served"
    return None


def check_activation(flat: dict) -> str | None:
    """A DSpark drafter on Qwen3's layers: their MLP's activation (Gemma 4's layers: gemma4_dspark.check)."""
    if flat.get("hidden_act", "silu") != "silu":
        return f"DSpark hidden_act {flat['hidden_act']!r} is not served (only silu)"
    return None


def check_block(flat: dict) -> str | None:
    """DSpark's block_size counts proposals (DFlash's own check, a bonus and masks, does not apply)."""
    p = flat["proposal_length"]
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        return f"DSpark block_size {p!r} drafts nothing"
    return None


def expected_shapes(flat: dict) -> dict[str, tuple[int, ...]]:
    """The DSpark tensors beyond a DFlash drafter's, named without a `model.` prefix."""
    v, r, h = flat["vocab_size"], flat["markov_rank"], flat["hidden_size"]
    shapes = {MARKOV + "markov_w1.weight": (v, r), MARKOV + "markov_w2.weight": (v, r)}
    if flat["enable_confidence_head"]:
        shapes |= {CONFIDENCE + "proj.weight": (1, h + r if flat["confidence_head_with_markov"] else h),
                   CONFIDENCE + "proj.bias": (1,)}
    return shapes
