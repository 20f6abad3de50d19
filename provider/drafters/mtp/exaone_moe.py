"""The MTP layer LG K-EXAONE (`exaone_moe`) checkpoints ship beside the target (`mtp.*`, which mlx-lm's exaone_moe
sanitize drops), loaded here as a drafter from the target's own files.

One head step, as vLLM's ExaoneMoeMultiTokenPredictor (exaone_moe_mtp.py) runs it:

    x = fc(concat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)])     # embed: the target's
    x = mtp.layers.0(x)     # an EXAONE-MoE decoder layer with a dense MLP (is_mtp), its attention per
                            # mtp_layer_types[0]: sliding (window, RoPE) or global (RoPE only in a model without
                            # sliding layers), q/k norms
    h_next = mtp.norm(x);  logits = the target's LM head(h_next)

where the pair (token t+1, h_t) sits at position t: h_t is the target's final-norm hidden at t (vLLM's ExaoneMoeModel
returns it normed), or for draft steps after the first the head's own h_next. Qwen3.5's MTP names (fc,
pre_fc_norm_*) on EXAONE's layer. The layer is mlx-lm's exaone_moe DecoderLayer, built on the target's arguments
with the MTP layer's type in front (so RoPE is decided as vLLM decides it) and a dense MLP; vLLM clamps that MLP at
swiglu_limits[0], which mlx-lm's layer cannot: such a checkpoint's head is refused. Its cache is a KVCache, masked
to the window when the layer is a sliding one (kept whole: trimmable after a rejection), booked so. The node loads
the first MTP layer and chains it k times; only it is read and booked. mlx-vlm 0.7.10 has no EXAONE drafter.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx

from .heads import finish_load, read_prefixed, target_dtype
from .nextn import NextNHead

FAMILIES = {"exaone_moe"}
DEPTH_KEY = "num_nextn_predict_layers"
PREFIX = "mtp."
_OWN = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm.", "layers.0.")


def _layer_type(config: dict) -> str:
    return (config.get("mtp_layer_types") or ["full_attention"])[0]


def _window(config: dict) -> int | None:
    """The MTP layer's window (vLLM: mtp_sliding_windows[0], else sliding_windows[0]); None for a global one."""
    if _layer_type(config) != "sliding_attention":
        return None
    return (config.get("mtp_sliding_windows") or config.get("sliding_windows") or [config["sliding_window"]])[0]


class ExaoneMoeMTPHead(NextNHead):
    PARTS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc")  # Qwen3.5's names on EXAONE's layer

    def __init__(self, args, config: dict):
        from mlx_lm.models.exaone_moe import DecoderLayer

        limits = config.get("swiglu_limits") or [0]
        if limits[0]:
            raise ValueError(f"the MTP layer's MLP is clamped at {limits[0]} (swiglu_limits), which mlx-lm's is not")
        mtp = dataclasses.replace(args, layer_types=[_layer_type(config), *args.layer_types], is_moe_layer=[False])
        super().__init__(args.hidden_size, args.rms_norm_eps, lambda: DecoderLayer(mtp, 0))
        self.window = _window(config)

    def mask(self, x: mx.array, cache):
        from mlx_lm.models.base import create_attention_mask

        return create_attention_mask(x, cache, window_size=self.window)


def serves(config: dict) -> bool:
    return config.get("model_type") in FAMILIES and depth(config) == 1


def depth(config: dict) -> int:
    """The head's decoder layers the node loads: the first MTP layer, if any is declared."""
    return min(int(config.get(DEPTH_KEY) or 0), 1)


def kv_elements(config: dict) -> int:
    """K and V a token (every position kept, a sliding layer's masked to its window)."""
    return 2 * int(config["num_key_value_heads"]) * int(config["head_dim"])


def head_tensors(names) -> list[str]:
    """The first MTP layer's tensors: `mtp.*` but the other layers' (`mtp.layers.<k>.`, k > 0)."""
    return [n for n in names if n.startswith(PREFIX) and n[len(PREFIX):].startswith(_OWN)]


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> ExaoneMoeMTPHead:
    """The head from the target's own checkpoint (only `mtp.*` of its first layer is read), in the target's dtype;
    the published `norm` is the head's `final_layernorm`, `layers.0` its block."""
    config = json.loads((path / "config.json").read_text())
    weights = {}
    for name, value in read_prefixed(path, PREFIX).items():
        if name.startswith("layers.0."):
            weights["block." + name[len("layers.0."):]] = value
        elif name.startswith("norm."):
            weights["final_layernorm." + name[len("norm."):]] = value
        elif not name.startswith("layers."):
            weights[name] = value
    head = ExaoneMoeMTPHead(model.args, config)
    return finish_load(head, weights, dtype or target_dtype(model), model.args.hidden_size)
