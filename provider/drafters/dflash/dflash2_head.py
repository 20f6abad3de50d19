"""The DFlash2 drafter as a model (checkpoints: drafters.dflash.dflash2), as mlx-vlm's DFlash2DraftModel computes it, on MLX
alone: a DFlash drafter (drafters.dflash.head) whose layers mix the block's positions causally and whose drafts are
chosen by a candidate selector.

Each layer wraps its attention and its MLP in a grouped dynamic causal convolution over the block's positions:

    y_t = sum_o (base[o] + dyn_t[o]) * x_{t-o}     per group of channels, o = 0..K-1, x_{t-o} = 0 before the block

`prepare` convolves the sublayer's (normed) input with the first base kernel and dynamic weights projected from that
input (kernel_projection), `finish` the sublayer's output with the second base kernel and the other half of the
same projection. The context K/V are the target's features alone, as DFlash's: the convolutions touch the block only.

The selector: position j's draft is one of the top-k tokens c of the base logits (output_multiplier, then the
softcap), scored  logit(c) + sum_r pred[prev]_r * proj(h_j)_r * succ[c]_r,  prev the token before it (the anchor,
then the draft drawn at j - 1). Greedy picks the best score; a sampled draft is drawn from the softmax of the scores
over the candidates (mlx-vlm's sample_proposal), which `proposal` gives as logits over the whole vocabulary (minus
infinity outside the candidates), so the engine's draw and its q are that distribution.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn

from .head import DFlashHead, DFlashLayer, load_dflash


def grouped_causal_convolve(x: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """x [B, L, H], dynamic [B, L, K, G] (G = H / group_size), base [K, H] -> [B, L, H]."""
    b, n, h = x.shape
    groups = h // group_size
    blocks = x.reshape(b, n, groups, group_size)
    out = mx.zeros_like(blocks)
    for o in range(base.shape[0]):
        shifted = blocks if o == 0 else mx.pad(blocks[:, :n - o], [(0, 0), (o, 0), (0, 0), (0, 0)])
        weight = base[o].reshape(1, 1, groups, group_size).astype(x.dtype) + dynamic[:, :, o, :, None]
        out = out + weight * shifted
    return out.reshape(x.shape)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The sublayer's input convolved, and the dynamic weights `finish` uses."""
        dynamic = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, -1)
        return grouped_causal_convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size), \
            dynamic[..., 1, :, :]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_causal_convolve(x, dynamic, self.base_kernel[1], self.group_size)


class DFlash2Layer(DFlashLayer):
    def __init__(self, flat: dict):
        super().__init__(flat)
        size = (flat["hidden_size"], flat["conv_kernel_size"], flat["conv_group_size"])
        self.attention_conv, self.mlp_conv = GroupedDynamicCausalConv(*size), GroupedDynamicCausalConv(*size)

    def __call__(self, x: mx.array, ctx: tuple | None, offset, mask: mx.array | None) -> mx.array:
        y, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(y, ctx, offset, mask), dynamic)
        y, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(y), dynamic)


class CandidateSelector(nn.Module):
    def __init__(self, flat: dict):
        super().__init__()
        v, r = flat["vocab_size"], flat["selector_rank"]
        self.top_k = flat["selector_top_k"]
        self.predecessor_codebook, self.successor_codebook = nn.Embedding(v, r), nn.Embedding(v, r)
        self.hidden_projection = nn.Linear(flat["hidden_size"], r, bias=False)

    def _edge(self, hidden: mx.array, previous: mx.array) -> mx.array:
        return self.predecessor_codebook(previous) * self.hidden_projection(hidden)  # [..., r]

    def scores(self, logits: mx.array, hidden: mx.array, previous: mx.array) -> tuple[mx.array, mx.array]:
        """One position's base logits [B, V], final hidden [B, H] and previous tokens [B] -> (candidates [B, k],
        their scores [B, k])."""
        candidates = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k:]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        edges = (self._edge(hidden, previous)[:, None] * self.successor_codebook(candidates)).sum(-1)
        return candidates, unary + edges

    def proposal(self, logits: mx.array, hidden: mx.array, previous: mx.array) -> mx.array:
        """The candidates' scores as logits over the vocabulary [B, V]: minus infinity outside the candidates. Under a
        grammar `logits` come masked, so the candidates are the best allowed tokens (a masked one scores -inf)."""
        candidates, scores = self.scores(logits, hidden, previous)
        floor = mx.full(logits.shape, -mx.inf, dtype=scores.dtype)
        return mx.put_along_axis(floor, candidates, scores, axis=-1)

    def every_score(self, logits: mx.array, hidden: mx.array, previous: mx.array) -> mx.array:
        """Every token's score [..., V] as a candidate (training: the candidates' are these, restricted)."""
        return logits + self._edge(hidden, previous) @ self.successor_codebook.weight.T


class DFlash2Head(DFlashHead):
    layer_class = DFlash2Layer

    def __init__(self, flat: dict):
        super().__init__(flat)
        self.candidate_selector = CandidateSelector(flat)
        self.input_scale, self.output_multiplier = flat["input_embedding_scale"], flat["output_multiplier"]

    def block(self, embeddings: mx.array, cache: list, offset: int) -> mx.array:
        return super().block(embeddings * self.input_scale, cache, offset)

    def block_rows(self, embeddings: mx.array, caches: list[list], offsets: list[int]) -> mx.array:
        if len(caches) == 1:  # DFlashHead's goes through `block`, which scales the embeddings
            return self.block(embeddings, caches[0], offsets[0])
        return super().block_rows(embeddings * self.input_scale, caches, offsets)

    def logits(self, hidden: mx.array, lm_head) -> mx.array:
        out = lm_head(hidden) * self.output_multiplier
        return out if self.softcap is None else mx.tanh(out / self.softcap) * self.softcap

    def selecting(self, hidden: mx.array, j: int, previous: mx.array):
        """For draft position j of the block's final hidden [B, L, H], given each row's previous token [B]: row i's
        (masked) base logits [1, V] -> the logits its draft is drawn from (acceptance.draw_drafts' `select`)."""
        h = hidden[:, 1 + j]
        return lambda i, own: self.candidate_selector.proposal(own, h[i:i + 1], previous[i:i + 1])


def load_dflash2(path: Path, model) -> DFlash2Head:
    return load_dflash(path, model, DFlash2Head)
