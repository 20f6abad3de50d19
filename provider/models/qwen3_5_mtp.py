"""The MTP head Qwen3.5 and Qwen3-Next checkpoints ship beside the target (`mtp.*`, which mlx-lm's sanitize drops),
loaded here as a drafter from the target's own files.

One head step, as vLLM's Qwen3NextMTP and mlx-vlm's qwen3_5_mtp drafter run it:

    x = fc(concat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)])
    x = layers(x)    # full-attention decoder layers with a KV cache of their own
    h_next = norm(x);  logits = the target's LM head(h_next)

where the pair (token t+1, h_t) sits at position t: h_t is the target's final-norm hidden state at t, or for
draft steps after the first the head's own h_next. The layers are mlx-lm's Qwen3.5 decoder layer with every
layer full attention (as mlx-vlm builds them), so the text-only install needs nothing beyond mlx-lm: mlx-vlm's
drafter class imports its own model zoo, and its weight conversion is the small `_hf_layout` below.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .mtp_heads import OwnHead

FAMILIES = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}  # their heads share this layout (mlx-vlm: one drafter)
PREFIX = "mtp."
DEPTH_KEY = "mtp_num_hidden_layers"
# Norms stored zero-centred in Hugging Face checkpoints (weight + 1.0 applied), as mlx-lm converts the target's.
_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                  ".k_norm.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def text_args(model):
    """The target's text-model arguments (mlx-lm's TextModelArgs)."""
    return getattr(model, "language_model", model).args


class Qwen35MTPHead(OwnHead):
    def __init__(self, args, depth: int):
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer

        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        one = replace(args, num_hidden_layers=depth, full_attention_interval=1)  # layer 0: full attention
        self.layers = [DecoderLayer(one, 0) for _ in range(depth)]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list | None) -> mx.array:
        """embeddings, hidden [B, L, H] (pairs: token t+1's embedding, the hidden at t) -> the head's hidden
        [B, L, H] (before the LM head), the pairs' K/V appended to `cache` (None: causal over the L pairs alone)."""
        cache = cache or [None] * len(self.layers)
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)],
                                   axis=-1))
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)


def serves(config: dict) -> bool:
    """Dense Qwen3.5 only: a MoE head's experts are not mapped yet."""
    tc = config.get("text_config") or config
    return config.get("model_type") == "qwen3_5" and not tc.get("num_experts")


def kv_elements(config: dict) -> int:
    tc = config.get("text_config") or config
    head_dim = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    return 2 * (tc.get("num_key_value_heads") or tc["num_attention_heads"]) * head_dim


def depth(config: dict) -> int:
    tc = config.get("text_config") or config
    return int(tc.get(DEPTH_KEY) or 0)


def head_tensors(names) -> list[str]:
    return [n for n in names if n.startswith(PREFIX)]


def _hf_layout(path: Path) -> bool:
    """Hugging Face layout (conv1d [C, 1, K], norms zero-centred) rather than mlx-lm's converted one: the same test
    mlx-lm's qwen3_5 sanitize applies to the target, so the head's norms follow the target's."""
    from .checkpoint import open_checkpoint

    return any("conv1d.weight" in n and shape[-1] != 1 for n, (_, shape) in open_checkpoint(path).tensors.items())


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> Qwen35MTPHead:
    """The head from the target's own checkpoint (only its `mtp.*` tensors are read), in the target's dtype."""
    config = json.loads((path / "config.json").read_text())
    head = Qwen35MTPHead(text_args(model), depth(config))
    centred = _hf_layout(path)
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, value in mx.load(str(f)).items():
            if name.startswith(PREFIX):
                name = name[len(PREFIX):]
                if centred and value.ndim == 1 and name.endswith(_CENTRED_NORMS):
                    value = value + 1.0
                weights[name] = value
    dtype = dtype or _target_dtype(model)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    # One step on this (loading) thread: MLX ties unevaluated arrays (RoPE tables) to the thread that made them.
    h = mx.zeros((1, 1, head.fc.weight.shape[0]), dtype=dtype)
    mx.eval(head(h, h, head.make_cache()))
    return head


def _target_dtype(model) -> mx.Dtype:
    embed = getattr(model, "language_model", model).model.embed_tokens
    return getattr(embed, "scales", embed.weight).dtype  # a quantized embedding's scales carry its float type
