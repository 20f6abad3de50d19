"""A Gemma 4 DSpark drafter as a model (checkpoints: drafters.dflash.gemma4_dspark): DFlashHead's context cache, block and
Markov correction (drafters.dflash.head, drafters.dflash.dspark_head) with Gemma 4's layers, as mlx-vlm's Gemma4DSparkDraftModel
computes them: per layer

    a = o_proj(attention(input_layernorm(x)))        # K = k_norm(k_proj(.)), V = k_proj(.) unnormed (k_eq_v), scale 1
    h = x + post_attention_layernorm(a)
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))   # GeGLU
    x = h * layer_scalar

and the block embedded by the drafter's own embedding scaled by sqrt(H), its logits read by its own LM head.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from .head import DFlashAttention, DFlashHead


class Gemma4DSparkAttention(DFlashAttention):
    def __init__(self, flat: dict):
        super().__init__(flat)  # head_dim and KV heads are the full-attention layers' (gemma4_dspark.add_keys)
        self.k_eq_v = bool(flat["keys_as_values"])
        if self.k_eq_v:
            del self.v_proj

    def _kv(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        if not self.k_eq_v:
            return super()._kv(x, offset)
        b, n, _ = x.shape
        k = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1)
        return self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=offset), k.transpose(0, 2, 1, 3)


class GeGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Gemma4DSparkLayer(nn.Module):
    def __init__(self, flat: dict):
        super().__init__()
        h, eps = flat["hidden_size"], flat.get("rms_norm_eps", 1e-6)
        self.self_attn = Gemma4DSparkAttention(flat)
        self.mlp = GeGLU(h, flat["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, ctx: tuple | None, offset, mask: mx.array | None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx, offset, mask))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class Gemma4DSparkHead(DFlashHead):
    layer_class = Gemma4DSparkLayer

    def __init__(self, flat: dict):
        super().__init__(flat)
        h, v = flat["hidden_size"], flat["vocab_size"]
        self.embed_tokens = nn.Embedding(v, h)
        self.lm_head = nn.Linear(h, v, bias=False)
        self.embed_scale = h ** 0.5  # a Python float, as mlx-vlm's and as the Gemma 4 target scales its own

    def embedding(self, model) -> tuple:
        """Its own embedding, scaled, and its own LM head (not the target's)."""
        return (lambda tokens: self.embed_tokens(tokens) * self.embed_scale), self.lm_head
