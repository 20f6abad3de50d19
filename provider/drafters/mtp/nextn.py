"""The NextN skeleton the MTP heads share (DeepSeek-V3's multi-token prediction module, and most heads after it):

    x = proj(concat[norm_e(embed(token t+1)), norm_h(h_t)])     # the hidden first in MiMo's
    x = the head's decoder layer(s)(x)                           # with a KV cache of their own
    h_next = final norm(x)                                       # where the family has one

A family's module subclasses NextNHead, names the parts as its checkpoint does (PARTS, BLOCK, FINAL) and keeps what
is its own: its decoder layer, its mask (a window, an array for MLA), its cache, embeddings zeroed at position 0,
an own embedding or LM head, a layer stack (Qwen3.5) or inline layer (LongCat). Nemotron-H's parts live in its
first block: it projects with `project` alone.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .heads import OwnHead, finish_load, read_prefixed, target_dtype


def project(norm_e, norm_h, proj, embeddings: mx.array, hidden: mx.array, hidden_first: bool = False) -> mx.array:
    """The pairs' embeddings and hidden states [B, L, H], each normed, concatenated and projected to [B, L, H]."""
    normed = [norm_e(embeddings), norm_h(hidden)]
    return proj(mx.concatenate(normed[::-1] if hidden_first else normed, axis=-1))


class NextNHead(OwnHead):
    PARTS = ("enorm", "hnorm", "eh_proj")  # the embedding's norm, the hidden's norm, the projection, as published
    HIDDEN_FIRST = False  # the concatenation's order (MiMo's: the hidden first, DeepSeek's reversed)
    BLOCK = "block"  # the decoder layer's name (ERNIE's: mtp_block)
    FINAL: str | None = "final_layernorm"  # the norm after the layer; None: the layer's output is the head's hidden

    def __init__(self, hidden: int, eps: float, make_block=None, *, bias: bool = False, vocab: int | None = None):
        """`make_block`: the decoder layer (None: the subclass builds its own after this); `vocab`: the size of an
        embedding the head ships of its own (None: it embeds with the target's)."""
        super().__init__()
        if vocab is not None:
            self.embed_tokens = nn.Embedding(vocab, hidden)
        embedding_norm, hidden_norm, projection = self.PARTS
        setattr(self, embedding_norm, nn.RMSNorm(hidden, eps=eps))
        setattr(self, hidden_norm, nn.RMSNorm(hidden, eps=eps))
        setattr(self, projection, nn.Linear(2 * hidden, hidden, bias=bias))
        if make_block is not None:
            setattr(self, self.BLOCK, make_block())  # after the projection: the order seeded fixtures draw weights in
        if self.FINAL:
            setattr(self, self.FINAL, nn.RMSNorm(hidden, eps=eps))

    def make_cache(self) -> list:
        return [KVCache()]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list | None) -> mx.array:
        """embeddings, hidden [B, L, H] (pairs: token t+1's embedding, the hidden at t) -> the head's hidden [B, L, H]
        (what `readout` maps for the LM head, and the next step's hidden), the pairs' K/V appended to `cache` (None:
        causal over the L pairs alone)."""
        first = cache[0] if cache else None
        parts = (getattr(self, name) for name in self.PARTS)
        x = project(*parts, self.masked_embeddings(embeddings, first), hidden, self.HIDDEN_FIRST)
        return self.final(self.layer(x, cache))

    def layer(self, x: mx.array, cache: list | None) -> mx.array:
        c = cache[0] if cache else None
        return getattr(self, self.BLOCK)(x, self.mask(x, c), c)

    def final(self, x: mx.array) -> mx.array:
        return getattr(self, self.FINAL)(x) if self.FINAL else x

    def masked_embeddings(self, embeddings: mx.array, cache) -> mx.array:
        return embeddings

    def mask(self, x: mx.array, cache):
        return create_attention_mask(x, cache)

    def load_from(self, path: Path, prefix: str, model, dtype: mx.Dtype | None, block_name=lambda name: name):
        """This head with the checkpoint's layer under `prefix` (the decoder layer's tensors named by
        `block_name`), in `dtype` (None: the target's)."""
        own = tuple(name for name in (*self.PARTS, self.FINAL) if name)
        weights = {k if k.startswith(own) else f"{self.BLOCK}." + block_name(k): v
                   for k, v in read_prefixed(path, prefix).items()}
        return finish_load(self, weights, dtype or target_dtype(model), model.args.hidden_size)


def at_position_zero_zeroed(embeddings: mx.array, offset) -> mx.array:
    """`embeddings` [B, L, H] of pairs from position `offset` (an int, or one per row: a batch cache's), the pair
    at position 0 zeroed (MiMo's and ERNIE's heads: "masking inputs at position 0")."""
    positions = mx.array(offset).reshape(-1, 1) + mx.arange(embeddings.shape[1])
    return mx.where((positions == 0)[..., None], mx.zeros_like(embeddings), embeddings)
