"""The DFlash drafter as a model (checkpoints: models.dflash), built on MLX and mlx-lm's classes only, so the
text-only install needs nothing else (mlx-vlm's drafter imports its own model zoo).

A round drafts a whole block in one forward, as z-lab's DFlash and mlx-vlm's DFlashDraftModel run it:

    ctx   = hidden_norm(fc(concat of the tapped target layers' outputs))   # at each committed position
    every layer's K/V of the context: k_norm(k_proj(ctx)), v_proj(ctx)    # the same ctx feeds every layer
    x     = embed([bonus, mask, ..., mask])                                # at the positions after the context
    x     = layer(x) for each layer: attention of the block's queries over [context K/V ; the block's own K/V],
            not causal (every block position sees every other), then the Qwen3 MLP
    logits of block positions 1..k = lm_head(norm(x))                      # the target's embedding and LM head

The context K/V of a position depend on the target's features alone (not on the layer's input), so each is
computed once, when the position is committed, and cached: the drafter's KV cache holds the context only; the
block's K/V are never cached, so a round leaves nothing to roll back. Each draft position's logits are fixed before
any draft is drawn, so the drafts of a sampled round are drawn independently, each from its own q.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from .dflash import canonical, flat_config, loaded
from .dspark import VARIANTS as DSPARK_VARIANTS
from .dspark_head import MarkovCorrection


class DFlashAttention(nn.Module):
    def __init__(self, flat: dict):
        super().__init__()
        h, d = flat["hidden_size"], flat["head_dim"]
        self.n_heads, self.n_kv_heads, self.head_dim = flat["num_attention_heads"], flat["num_key_value_heads"], d
        self.scale = flat.get("attention_scale", d ** -0.5)  # Gemma 4's is 1 (models.gemma4_dspark)
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=flat.get("rms_norm_eps", 1e-6))
        self.k_norm = nn.RMSNorm(d, eps=flat.get("rms_norm_eps", 1e-6))
        self.rope = initialize_rope(d, flat["rope_theta"], flat.get("rope_traditional", False),
                                    flat.get("rope_scaling"), flat.get("max_position_embeddings", 32768))

    def _kv(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def context(self, ctx: mx.array, cache: KVCache, offset: int) -> None:
        """Committed positions' context [B, n, H] (from `offset`) into the cache."""
        cache.update_and_fetch(*self._kv(ctx, offset))

    def __call__(self, x: mx.array, ctx: tuple | None, offset, mask: mx.array | None) -> mx.array:
        """The block x [B, L, H] at positions from `offset` (an int, or one per row), over its context K/V `ctx`
        (None: none yet) and itself, not causal; `mask` [B, 1, 1, S] hides rows' left padding."""
        b, n, _ = x.shape
        q = self.rope(self.q_norm(self.q_proj(x).reshape(b, n, self.n_heads, -1)).transpose(0, 2, 1, 3),
                      offset=offset)
        k, v = self._kv(x, offset)
        if ctx is not None:
            k, v = mx.concatenate([ctx[0], k], axis=2), mx.concatenate([ctx[1], v], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, flat: dict):
        super().__init__()
        h, eps = flat["hidden_size"], flat.get("rms_norm_eps", 1e-6)
        self.self_attn = DFlashAttention(flat)
        self.mlp = MLP(h, flat["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)

    def __call__(self, x: mx.array, ctx: tuple | None, offset, mask: mx.array | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), ctx, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def _left_padded(x: mx.array | None, n: int, width: int) -> mx.array:
    """A row's first n cached positions [1, heads, n, d], zeros before them up to `width`. A row always has some
    context when it drafts (its first round reads the last prompt token's features)."""
    return mx.pad(x[..., :n, :], [(0, 0), (0, 0), (width - n, 0), (0, 0)])


class DFlashHead(nn.Module):
    """The drafter: `context` takes committed positions' tapped features, `block` a round's block embeddings."""

    layer_class = DFlashLayer

    def __init__(self, flat: dict):
        super().__init__()
        h = flat["hidden_size"]
        self.fc = nn.Linear(len(flat["target_layer_ids"]) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=flat.get("rms_norm_eps", 1e-6))
        self.layers = [self.layer_class(flat) for _ in range(flat["num_hidden_layers"])]
        self.norm = nn.RMSNorm(h, eps=flat.get("rms_norm_eps", 1e-6))
        self.mask_token_id, self.block_size = flat["mask_token_id"], flat["block_size"]
        self.softcap = flat.get("final_logit_softcapping")
        # DSpark (models.dspark): the Markov correction, and whether the anchor's position drafts the first token
        dspark = flat.get("variant") in DSPARK_VARIANTS
        self.markov_head = MarkovCorrection(flat["vocab_size"], flat["markov_rank"]) if dspark else None
        self.from_anchor = int(dspark and bool(flat["sample_from_anchor"]))
        self.tap = None  # verification.hidden_tap.LayerTap on the target, set by load_dflash

    def embedding(self, model) -> tuple:
        """(embed, lm_head) the block is embedded and its logits read with: the target's."""
        return target_embedding(model)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def context(self, features: mx.array, cache: list, offset: int) -> None:
        """features [B, n, len(ids) * H]: the tapped outputs at n committed positions from `offset`."""
        ctx = self.hidden_norm(self.fc(features))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.context(ctx, c, offset)

    def block(self, embeddings: mx.array, cache: list, offset: int) -> mx.array:
        """One row's block embeddings [1, L, H] at positions from `offset` -> its final hidden [1, L, H]."""
        h = embeddings
        for layer, c in zip(self.layers, cache):
            h = layer(h, (c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) if c.offset else None, offset, None)
        return self.norm(h)

    def block_rows(self, embeddings: mx.array, caches: list[list], offsets: list[int]) -> mx.array:
        """Several rows' blocks [B, L, H] (row i at positions from offsets[i]) in one forward, their contexts of
        different lengths left-padded to the longest and masked -> [B, L, H]."""
        if len(caches) == 1:
            return self.block(embeddings, caches[0], offsets[0])
        lengths = [c[0].offset for c in caches]
        width = max(lengths)
        mask = mx.array([[j >= width - n for j in range(width)] + [True] * embeddings.shape[1] for n in lengths])
        h = embeddings
        for i, layer in enumerate(self.layers):
            ctx = tuple(mx.concatenate([_left_padded(getattr(c[i], name), n, width) for c, n in zip(caches, lengths)])
                        for name in ("keys", "values")) if width else None
            h = layer(h, ctx, mx.array(offsets), mask[:, None, None, :])
        return self.norm(h)

    def block_tokens(self, last: int, k: int) -> list[int]:
        """A round's block for k drafts: [last, mask x k], or [last, mask x (k - 1)] when the anchor drafts."""
        return [last] + [self.mask_token_id] * (k - self.from_anchor)

    def draft_logits(self, hidden: mx.array, lm_head) -> mx.array:
        """The block's final hidden [B, L, H] -> the k draft positions' (base) logits [B, k, V]."""
        return self.logits(hidden if self.from_anchor else hidden[:, 1:], lm_head)

    def logits(self, hidden: mx.array, lm_head) -> mx.array:
        out = lm_head(hidden)
        return out if self.softcap is None else mx.tanh(out / self.softcap) * self.softcap


def target_embedding(model) -> tuple:
    """(embed, lm_head) of the target as the drafter reads them: the block's token embeddings scaled as the target's
    forward scales its own (Gemma 4 by sqrt(H), mlx-vlm's DFlash bind likewise), the target's LM head or its tied
    embedding, unscaled (the drafter's own final softcap, if any, is applied after it)."""
    lm = getattr(model, "language_model", model)
    embedding = lm.model.embed_tokens
    scale = getattr(embedding, "embed_scale", getattr(lm.model, "embed_scale", 1.0))
    embed = embedding if scale == 1.0 else (lambda tokens: embedding(tokens) * scale)
    return embed, getattr(lm, "lm_head", None) or embedding.as_linear


def load_dflash(path: Path, model, head_class=DFlashHead) -> DFlashHead:
    """The drafter at `path` for the loaded target `model` (paired already: models.dflash.check_pair), in its own
    dtype, and the target's layer tap installed (only now: a target without a DFlash drafter has none);
    `head_class`: a DFlashHead's subclass (models.dflash2_head's)."""
    from ..verification.hidden_tap import install_layers

    flat = flat_config(json.loads((path / "config.json").read_text()))
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights |= {canonical(k): v for k, v in mx.load(str(f)).items() if loaded(k)}
    head = head_class(flat)
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    head.tap = install_layers(model, sorted(flat["target_layer_ids"]))
    # One step on this (loading) thread: MLX ties unevaluated arrays (RoPE tables) to the thread that made them.
    dtype, h = head.fc.weight.dtype, head.fc.weight.shape[0]
    cache = head.make_cache()
    head.context(mx.zeros((1, 1, head.fc.weight.shape[1]), dtype=dtype), cache, 0)
    mx.eval(head.block(mx.zeros((1, 2, h), dtype=dtype), cache, 1))
    return head
