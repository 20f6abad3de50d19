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

from .nextn import NextNHead, at_position_zero_zeroed

FAMILIES = {"mimo"}
PREFIX = "model.mtp_layers.0."
DEPTH_KEY = "num_nextn_predict_layers"


class MiMoMTPHead(NextNHead):
    PARTS = ("token_layernorm", "hidden_layernorm", "input_proj")
    HIDDEN_FIRST = True  # DeepSeek's order reversed

    def __init__(self, args):
        from mlx_lm.models.mimo import TransformerBlock

        super().__init__(args.hidden_size, args.rms_norm_eps, lambda: TransformerBlock(args))

    def masked_embeddings(self, embeddings: mx.array, cache) -> mx.array:
        return at_position_zero_zeroed(embeddings, 0 if cache is None else cache.offset)


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
