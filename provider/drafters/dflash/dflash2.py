"""DFlash2 drafters (mlx-vlm's `dflash2`: DFlash2DraftModel), served as the `dflash` kind (issue 42). This module
holds what the config and the safetensors headers decide beyond a DFlash drafter's (drafters.dflash.config); the layers and
the candidate selector are drafters.dflash.dflash2_head.

A checkpoint is DFlash2 when an architecture or its model type names it (mlx-vlm's get_model_type: the
DFlash2DraftModel architecture). Its `dflash_config` adds, over DFlash's keys: `conv_kernel_size` and
`conv_group_size` (each layer's two grouped dynamic causal convolutions over the block's positions, around its
attention and its MLP), `selector_rank` and `selector_top_k` (the candidate selector: position j's draft is one of
the base logits' top-k, scored by its logit plus a rank-r edge of the token before it, the position's hidden and the
candidate), `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` (each read from dflash_config or
else the top level, as mlx-vlm reads them). Its extra tensors, per layer `attention_conv` and `mlp_conv`:
`base_kernel` [2, K, H] and `kernel_projection.weight` [2 K G, H] (G = H / group size groups); and
`candidate_selector.predecessor_codebook` and `successor_codebook` [V, r] (named with or without `.weight`, as
mlx-vlm's sanitize takes them) and `candidate_selector.hidden_projection.weight` [r, H].
"""

from __future__ import annotations

VARIANT = "dflash2"
SELECTOR = "candidate_selector."
CODEBOOKS = (SELECTOR + "predecessor_codebook", SELECTOR + "successor_codebook")
# mlx-vlm's DFlash2Config.from_dict: dflash_config's over the top level's over these defaults (0: refused by check)
DEFAULTS = {"conv_kernel_size": 0, "conv_group_size": 0, "selector_rank": 0, "selector_top_k": 0,
            "input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def is_dflash2(config: dict) -> bool:
    names = [str(a).lower() for a in config.get("architectures") or []] + [str(config.get("model_type", "")).lower()]
    return any(VARIANT in n for n in names)


def add_keys(config: dict, flat: dict) -> None:
    """The DFlash2 keys of `config` into `flat`, as mlx-vlm reads them."""
    inner = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    for key, default in DEFAULTS.items():
        flat[key] = inner.get(key, config.get(key, default))


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(flat: dict) -> str | None:
    """Why a DFlash2 config drafts otherwise than the node runs it, or None."""
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if not _positive(flat[key]):
            return f"malformed DFlash2 config: {key} is {flat[key]!r}"
    h = flat.get("hidden_size")
    if not _positive(h) or h % flat["conv_group_size"]:
        return f"DFlash2 conv_group_size {flat['conv_group_size']} does not divide hidden_size {h}"
    if not _positive(flat.get("vocab_size")) or flat["selector_top_k"] > flat["vocab_size"]:
        return f"DFlash2 selector_top_k {flat['selector_top_k']} exceeds the vocabulary"
    for key in ("input_embedding_scale", "output_multiplier"):
        if not _number(flat[key]):
            return f"malformed DFlash2 config: {key} is {flat[key]!r}"
    cap = flat["final_logit_softcapping"]
    if cap is not None and (not _number(cap) or cap <= 0):
        return f"malformed DFlash2 config: final_logit_softcapping is {cap!r}"
    if flat.get("hidden_act", "silu") != "silu":
        return f"DFlash2 hidden_act {flat['hidden_act']!r} is not served (only silu)"
    return None


def expected_shapes(flat: dict) -> dict[str, tuple[int, ...]]:
    """The DFlash2 tensors beyond a DFlash drafter's, named without a `model.` prefix."""
    h, v, r = flat["hidden_size"], flat["vocab_size"], flat["selector_rank"]
    kernel, groups = flat["conv_kernel_size"], flat["hidden_size"] // flat["conv_group_size"]
    shapes = {c + ".weight": (v, r) for c in CODEBOOKS} | {SELECTOR + "hidden_projection.weight": (r, h)}
    for n in range(flat["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{n}.{conv}."
            shapes |= {p + "base_kernel": (2, kernel, h), p + "kernel_projection.weight": (2 * kernel * groups, h)}
    return shapes


def canonical(name: str) -> str:
    """A tensor's name as the node loads it: the codebooks as embeddings' weights (mlx-vlm's sanitize)."""
    return name + ".weight" if name in CODEBOOKS else name
