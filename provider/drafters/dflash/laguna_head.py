"""A Laguna DFlash drafter as a model (checkpoints: drafters.dflash.laguna): DFlashHead (drafters.dflash.head) with each
tapped slice of the context normed by its own `aux_hidden_norms`, and attention gated per head, as mlx-vlm's
LagunaDFlashDraftModel computes it:

    ctx = hidden_norm(fc(concat_i aux_hidden_norms[i](features of tapped layer i)))
    o   = attention(q, [context K/V ; block K/V]) * softplus(g_proj(x))   # per head; x the layer's normed input
    out = o_proj(o)

Its block is causal and its window W: the mask is DFlashHead's (context_window W - 1, causal_block).
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from .head import DFlashAttention, DFlashHead, DFlashLayer


class GatedAttention(DFlashAttention):
    def __init__(self, flat: dict):
        super().__init__(flat)
        self.g_proj = nn.Linear(flat["hidden_size"], self.n_heads, bias=False)

    def gated(self, o: mx.array, x: mx.array) -> mx.array:
        """o [B, L, heads, D] scaled by softplus(g_proj(x)) per head, computed in float32 as mlx-vlm does."""
        return o * nn.softplus(self.g_proj(x).astype(mx.float32)).astype(o.dtype)[..., None]


class LagunaLayer(DFlashLayer):
    attention_class = GatedAttention


class LagunaHead(DFlashHead):
    layer_class = LagunaLayer

    def __init__(self, flat: dict):
        super().__init__(flat)
        self.aux_hidden_norms = [nn.RMSNorm(flat["hidden_size"], eps=flat.get("rms_norm_eps", 1e-6))
                                 for _ in flat["target_layer_ids"]]

    def context(self, features: mx.array, cache: list, offset: int) -> None:
        slices = mx.split(features, len(self.aux_hidden_norms), axis=-1)
        super().context(mx.concatenate([norm(s) for norm, s in zip(self.aux_hidden_norms, slices)], axis=-1),
                        cache, offset)
