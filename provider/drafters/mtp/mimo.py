"""The MTP layer Xiaomi MiMo checkpoints ship beside the target (`model.mtp_layers.0.*`, which mlx-lm's mimo sanitize
drops), loaded here as a drafter from the target's own files.

One head step, as vLLM's MiMoMultiTokenPredictorLayer runs it (vllm/model_executor/models/mimo_mtp.py):

    e = embed(token), zeroed where the pair sits at position 0 (vLLM: "masking inputs at position 0")
    x = input_proj(concat[hidden_layernorm(h), token_layernorm(e)])     # the hidden first: DeepSeek's order reversed
    x = decoder layer(x)     # a Qwen2-style layer (biased q/k/v) with a KV cache of its own
    h_next = final_layernorm(x);  logits = the target's LM head(h_next)     # embedding and LM head: the target's

where the pair (token t+1, h_t) sits at position t: h_t is the target's final-norm hidden at t, or for draft steps
after the first the head's own h_next. vLLM drafts one token per round with it (spec_step_idx 0 only); the node
chains the same layer k times, as it does every one-layer head. The layer is mlx-lm's own mimo TransformerBlock, so
the text-only install needs nothing beyond mlx-lm; mlx-vlm has no MiMo drafter. A checkpoint that declares more
than one MTP layer is served with its first (vLLM's too); only that layer is read and booked.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .heads import OwnHead, finish_load, read_prefixed, target_dtype

FAMILIES = {"mimo"}
PREFIX = "model.mtp_layers.0."
DEPTH_KEY = "num_nextn_predict_layers"


class PairProjectionHead(OwnHead):
    """A MiMo-style MTP layer: the pair's embedding and hidden each RMS-normed, projected from their concatenation
    to the hidden size, one decoder layer (`block`) and a final norm. A subclass names the first three parts as its
    checkpoint does (PARTS), orders the concatenation (HIDDEN_FIRST), and may mask the embeddings and the scores."""

    PARTS: tuple[str, str, str]  # the embedding's norm, the hidden's norm, the projection
    HIDDEN_FIRST: bool

    def __init__(self, hidden: int, eps: float, make_block):
        super().__init__()
        embedding_norm, hidden_norm, projection = self.PARTS
        setattr(self, embedding_norm, nn.RMSNorm(hidden, eps=eps))
        setattr(self, hidden_norm, nn.RMSNorm(hidden, eps=eps))
        setattr(self, projection, nn.Linear(2 * hidden, hidden, bias=False))
        self.block = make_block()  # after the projection: the order seeded fixtures draw their weights in
        self.final_layernorm = nn.RMSNorm(hidden, eps=eps)

    def make_cache(self) -> list:
        return [KVCache()]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list | None) -> mx.array:
        """embeddings, hidden [B, L, H] (pairs: token t+1's embedding, the hidden at t) -> the head's hidden
        [B, L, H] (before the LM head), the pairs' K/V appended to `cache` (None: causal over the L pairs alone)."""
        c = cache[0] if cache else None
        embedding_norm, hidden_norm, projection = (getattr(self, name) for name in self.PARTS)
        normed = [embedding_norm(self.masked_embeddings(embeddings, c)), hidden_norm(hidden)]
        x = projection(mx.concatenate(normed[::-1] if self.HIDDEN_FIRST else normed, axis=-1))
        return self.final_layernorm(self.block(x, self.mask(x, c), c))

    def masked_embeddings(self, embeddings: mx.array, cache) -> mx.array:
        return embeddings

    def mask(self, x: mx.array, cache):
        return create_attention_mask(x, cache)

    def load_from(self, path: Path, prefix: str, model, dtype: mx.Dtype | None, block_name=lambda name: name):
        """This head with the checkpoint's layer under `prefix` (the decoder layer's tensors named by
        `block_name`), in `dtype` (None: the target's)."""
        own = (*self.PARTS, "final_layernorm")
        weights = {k if k.startswith(own) else "block." + block_name(k): v
                   for k, v in read_prefixed(path, prefix).items()}
        return finish_load(self, weights, dtype or target_dtype(model), model.args.hidden_size)


class MiMoMTPHead(PairProjectionHead):
    PARTS = ("token_layernorm", "hidden_layernorm", "input_proj")
    HIDDEN_FIRST = True  # DeepSeek's order reversed

    def __init__(self, args):
        from mlx_lm.models.mimo import TransformerBlock

        super().__init__(args.hidden_size, args.rms_norm_eps, lambda: TransformerBlock(args))

    def masked_embeddings(self, embeddings: mx.array, cache) -> mx.array:
        return at_position_zero_zeroed(embeddings, 0 if cache is None else cache.offset)


def at_position_zero_zeroed(embeddings: mx.array, offset) -> mx.array:
    """`embeddings` [B, L, H] of pairs from position `offset` (an int, or one per row: a batch cache's), the pair
    at position 0 zeroed."""
    positions = mx.array(offset).reshape(-1, 1) + mx.arange(embeddings.shape[1])
    return mx.where((positions == 0)[..., None], mx.zeros_like(embeddings), embeddings)


def serves(config: dict) -> bool:
    return config.get("model_type") in FAMILIES and depth(config) == 1


def depth(config: dict) -> int:
    """The head's decoder layers the node loads: the first MTP layer, if any is declared."""
    return min(int(config.get(DEPTH_KEY) or 0), 1)


def kv_elements(config: dict) -> int:
    """K and V a token: mlx-lm's mimo attention takes head_dim = hidden_size / heads (whatever `head_dim` says)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 2 * (config.get("num_key_value_heads") or config["num_attention_heads"]) * head_dim


def head_tensors(names) -> list[str]:
    return [n for n in names if n.startswith(PREFIX)]


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> MiMoMTPHead:
    """The head from the target's own checkpoint (only `model.mtp_layers.0.*` is read), in the target's dtype."""
    return MiMoMTPHead(model.args).load_from(path, PREFIX, model, dtype)
