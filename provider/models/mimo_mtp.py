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

from .mtp_heads import OwnHead, finish_load, read_prefixed, target_dtype

FAMILIES = {"mimo"}
PREFIX = "model.mtp_layers.0."
DEPTH_KEY = "num_nextn_predict_layers"
_OWN = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")  # beside the decoder layer


class MiMoMTPHead(OwnHead):
    def __init__(self, args):
        super().__init__()
        from mlx_lm.models.mimo import TransformerBlock

        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.token_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = TransformerBlock(args)
        self.final_layernorm = nn.RMSNorm(hidden, eps=eps)

    def make_cache(self) -> list:
        return [KVCache()]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list | None) -> mx.array:
        """embeddings, hidden [B, L, H] (pairs: token t+1's embedding, the hidden at t) -> the head's hidden
        [B, L, H] (before the LM head), the pairs' K/V appended to `cache` (None: causal over the L pairs alone)."""
        c = cache[0] if cache else None
        embeddings = at_position_zero_zeroed(embeddings, 0 if c is None else c.offset)
        x = self.input_proj(mx.concatenate([self.hidden_layernorm(hidden), self.token_layernorm(embeddings)], axis=-1))
        x = self.block(x, create_attention_mask(x, c), c)
        return self.final_layernorm(x)


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
    head = MiMoMTPHead(model.args)
    weights = {k if k.startswith(_OWN) else "block." + k: v for k, v in read_prefixed(path, PREFIX).items()}
    return finish_load(head, weights, dtype or target_dtype(model), model.args.hidden_size)
