"""The DFlash drafter as a model (checkpoints: drafters.dflash.config), built on MLX and mlx-lm's classes only, so the
text-only install needs nothing else (mlx-vlm's drafter imports its own model zoo).

A round drafts a whole block in one forward, as z-lab's DFlash and mlx-vlm's DFlashDraftModel run it:

    ctx   = hidden_norm(fc(concat of the tapped target layers' outputs))   # at each committed position
    every layer's K/V of the context: k_norm(k_proj(ctx)), v_proj(ctx)    # the same ctx feeds every layer
    x     = embed([bonus, mask, ..., mask])                                # at the positions after the context
    x     = layer(x) for each layer: attention of the block's queries over [context K/V ; the block's own K/V],
            not causal (every block position sees every other; Laguna's are causal), then the Qwen3 MLP
    logits of block positions 1..k = lm_head(norm(x))                      # the target's embedding and LM head

The context K/V of a position depend on the target's features alone (not on the layer's input), so each is
computed once, when the position is committed, and cached: the drafter's KV cache holds the context only; the
block's K/V are never cached, so a round leaves nothing to roll back. A windowed drafter (MuseGlimmer's, Laguna's)
keeps the last positions of its window only (WindowedContext), and each block query sees those within it (_mask).
Each draft position's logits are fixed before any draft is drawn, so the drafts of a sampled round are drawn
independently, each from its own q.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from .config import canonical_tensors, flat_config, loaded
from .dspark_head import MarkovCorrection


class DFlashAttention(nn.Module):
    def __init__(self, flat: dict):
        super().__init__()
        h, d = flat["hidden_size"], flat["head_dim"]
        self.n_heads, self.n_kv_heads, self.head_dim = flat["num_attention_heads"], flat["num_key_value_heads"], d
        self.scale = flat.get("attention_scale", d ** -0.5)  # Gemma 4's is 1 (drafters.dflash.gemma4_dspark)
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
        (None: none yet) and itself; `mask` [B, 1, L, S] (DFlashHead._mask) or None: every key seen."""
        b, n, _ = x.shape
        q = self.rope(self.q_norm(self.q_proj(x).reshape(b, n, self.n_heads, -1)).transpose(0, 2, 1, 3),
                      offset=offset)
        k, v = self._kv(x, offset)
        if ctx is not None:
            k, v = mx.concatenate([ctx[0], k], axis=2), mx.concatenate([ctx[1], v], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(self.gated(o.transpose(0, 2, 1, 3), x).reshape(b, n, -1))

    def gated(self, o: mx.array, x: mx.array) -> mx.array:
        """The heads' outputs o [B, L, heads, D] before o_proj: ungated (Laguna's are: drafters.dflash.laguna_head)."""
        return o


class DFlashLayer(nn.Module):
    attention_class = DFlashAttention

    def __init__(self, flat: dict):
        super().__init__()
        h, eps = flat["hidden_size"], flat.get("rms_norm_eps", 1e-6)
        self.self_attn = self.attention_class(flat)
        self.mlp = MLP(h, flat["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)

    def __call__(self, x: mx.array, ctx: tuple | None, offset, mask: mx.array | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), ctx, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class WindowedContext:
    """A windowed drafter's context cache: the K/V of its last `window` committed positions (no block query sees
    further back), `offset` the positions committed. Concatenated and trimmed as a round commits its few positions;
    its books: the window's K/V, as a sliding-window layer's (memory.estimate)."""

    def __init__(self, window: int):
        self.window, self.keys, self.values, self.offset = window, None, None, 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.offset += keys.shape[2]
        if self.keys is not None:
            keys, values = mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = keys[..., -self.window:, :], values[..., -self.window:, :]
        return self.keys, self.values

    @property
    def state(self) -> tuple:
        return self.keys, self.values


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
        # DSpark's (drafters.dflash.dspark): the Markov correction, and whether the anchor's position drafts the first
        dspark = bool(flat.get("markov"))  # its variant's row says so (drafters.dflash.variants)
        self.markov_head = MarkovCorrection(flat["vocab_size"], flat["markov_rank"]) if dspark else None
        self.from_anchor = int(dspark and bool(flat["sample_from_anchor"]))
        # MuseGlimmer's (drafters.dflash.muse_glimmer): a context window, the target's output map on its logits;
        # Laguna's (drafters.dflash.laguna): a window and a causal block
        self.window, self.target_logits = flat.get("context_window"), bool(flat.get("target_logits"))
        self.causal = bool(flat.get("causal_block"))
        self.tap = None  # proofs.hidden_tap.LayerTap on the target, set by load_dflash

    def embedding(self, model) -> tuple:
        """(embed, lm_head) the block is embedded and its logits read with: the target's. A MuseGlimmer assistant's
        logits then multiplied and capped as the target's own (mlx-vlm reads them raw: a monotonic map, so the greedy
        drafts are the same, but the sampled drafts' q is then as sharp as the target's p, not five times sharper)."""
        embed, lm_head = target_embedding(model)
        args = getattr(model, "args", None)
        if not self.target_logits or args is None:
            return embed, lm_head
        scale, cap = getattr(args, "output_multiplier", 1.0), getattr(args, "final_logit_softcapping", None)

        def as_the_targets(hidden: mx.array) -> mx.array:
            out = lm_head(hidden) * scale
            return out if not cap else mx.tanh(out / cap) * cap

        return embed, as_the_targets

    def make_cache(self) -> list:
        return [KVCache() if self.window is None else WindowedContext(self.window) for _ in self.layers]

    def context(self, features: mx.array, cache: list, offset: int) -> None:
        """features [B, n, len(ids) * H]: the tapped outputs at n committed positions from `offset`. A windowed
        drafter projects only the last window of them (a long prompt's earlier positions no query will see)."""
        if self.window is not None and features.shape[1] > self.window:
            skip = features.shape[1] - self.window
            features, offset = features[:, skip:], offset + skip
            for c in cache:
                c.offset += skip
        ctx = self.hidden_norm(self.fc(features))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.context(ctx, c, offset)

    def _held(self, c) -> tuple[mx.array, mx.array] | None:
        """A layer cache's context K/V a block may attend to: every position, or a windowed drafter's last window."""
        if not c.offset:
            return None
        k, v = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
        return (k, v) if self.window is None else (k[..., -self.window:, :], v[..., -self.window:, :])

    def _mask(self, lengths: list[int], length: int) -> mx.array | None:
        """[B, 1, L, S]: row i's context (lengths[i] positions, right-aligned in the S - L slots before the block) and
        its block of L; with a window, query j sees the positions within it (|q - k| <= window: transformers' DFlash
        mask); with a causal block, the block's positions up to its own. None when every query sees every slot."""
        width = max(lengths)
        if self.window is None and not self.causal and all(n == width for n in lengths):
            return None
        rel = mx.arange(width + length)[None, :] - width  # each slot's position relative to the block's first
        query = mx.arange(length)[:, None]
        seen = mx.abs(query - rel) <= (self.window if self.window is not None else width + length)
        if self.causal:
            seen = seen & (rel <= query)
        return mx.stack([seen & (rel >= -n) for n in lengths])[:, None]

    def block(self, embeddings: mx.array, cache: list, offset: int) -> mx.array:
        """One row's block embeddings [1, L, H] at positions from `offset` -> its final hidden [1, L, H]."""
        held = [self._held(c) for c in cache]
        mask = self._mask([0 if held[0] is None else held[0][0].shape[2]], embeddings.shape[1])
        h = embeddings
        for layer, ctx in zip(self.layers, held):
            h = layer(h, ctx, offset, mask)
        return self.norm(h)

    def block_rows(self, embeddings: mx.array, caches: list[list], offsets: list[int]) -> mx.array:
        """Several rows' blocks [B, L, H] (row i at positions from offsets[i]) in one forward, their contexts of
        different lengths left-padded to the longest and masked -> [B, L, H]."""
        if len(caches) == 1:
            return self.block(embeddings, caches[0], offsets[0])
        held = [[self._held(c) for c in row] for row in caches]  # a row drafts after its prompt: some context
        lengths = [row[0][0].shape[2] for row in held]
        width, mask = max(lengths), self._mask(lengths, embeddings.shape[1])
        h = embeddings
        for i, layer in enumerate(self.layers):
            ctx = tuple(mx.concatenate([_left_padded(row[i][t], n, width) for row, n in zip(held, lengths)])
                        for t in (0, 1))
            h = layer(h, ctx, mx.array(offsets), mask)
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
    """The drafter at `path` for the loaded target `model` (paired already: drafters.dflash.config.check_pair), in its own
    dtype, and the target's layer tap installed (only now: a target without a DFlash drafter has none);
    `head_class`: DFlashHead or its variant's subclass (its row's, drafters.dflash.variants)."""
    from ...proofs.hidden_tap import install_layers

    flat = flat_config(json.loads((path / "config.json").read_text()))
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights |= canonical_tensors(flat, {k: v for k, v in mx.load(str(f)).items() if loaded(k)})
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
