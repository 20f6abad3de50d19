"""The MTP layers Xiaomi MiMo-V2-Flash checkpoints ship beside the target (`model.mtp.layers.<k>.*`, which mlx-lm's
mimo_v2_flash sanitize drops), the first loaded here as a drafter from the target's own files.

One head step, as SGLang's MiMoV2ModelNextN (and vLLM's mimo_v2_mtp.py) run it:

    x = eh_proj(concat[enorm(embed(token)), hnorm(h)])     # embed: the target's
    x = decoder layer(x)     # the target's sliding-window attention (window, sinks, SWA RoPE, its V head size)
                             # with a dense MLP
    h_next = final_layernorm(x);  logits = the target's LM head(h_next)

where the pair (token t+1, h_t) sits at position t: h_t is the target's final-norm hidden at t, or for draft steps
after the first the head's own h_next. The published layer names its second norm `pre_mlp_layernorm` (mlx-lm's
`post_attention_layernorm`). The layer is mlx-lm's own mimo_v2_flash DecoderLayer (sliding, dense), so the text-only
install needs nothing beyond mlx-lm. Its cache is a plain KVCache masked to the window (a rotating one could not be
trimmed back after a rejection once it wraps), so it holds every position: booked so. MiMo-V2-Flash declares
several MTP layers; the node chains its first k times (as for every one-layer head), the only one read and booked.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from .nextn import NextNHead

FAMILIES = {"mimo_v2_flash"}
PREFIX = "model.mtp.layers.0."
DEPTH_KEY = "num_nextn_predict_layers"


class MiMoV2MTPHead(NextNHead):

    def __init__(self, args):
        from mlx_lm.models.mimo_v2_flash import DecoderLayer

        super().__init__(args.hidden_size, args.layernorm_epsilon,
                         lambda: DecoderLayer(args, is_moe=False, is_sliding_window=True))
        self.window = args.sliding_window_size

    def mask(self, x: mx.array, cache):
        return create_attention_mask(x, cache, window_size=self.window, return_array=True)  # sinks: an array mask


def serves(config: dict) -> bool:
    return config.get("model_type") in FAMILIES and depth(config) == 1


def depth(config: dict) -> int:
    """The head's decoder layers the node loads: the first MTP layer, if any is declared."""
    return min(int(config.get(DEPTH_KEY) or 0), 1)


def kv_elements(config: dict) -> int:
    """K and V a token of the sliding-window attention (keys swa_head_dim, values swa_v_head_dim a KV head); the
    cache keeps every position (masked to the window), so a token is booked whole."""
    heads = config["swa_num_key_value_heads"]
    return heads * (config["swa_head_dim"] + config["swa_v_head_dim"])


def head_tensors(names) -> list[str]:
    return [n for n in names if n.startswith(PREFIX)]


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> MiMoV2MTPHead:
    """The head from the target's own checkpoint (only `model.mtp.layers.0.*` is read), in the target's dtype; the
    layer's `pre_mlp_layernorm` is mlx-lm's `post_attention_layernorm`."""
    return MiMoV2MTPHead(model.args).load_from(
        path, PREFIX, model, dtype, lambda name: name.replace("pre_mlp_layernorm", "post_attention_layernorm"))
