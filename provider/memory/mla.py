"""What mlx-lm's caches hold a token in a layer of multi-head latent attention (MLA), from the config alone. Pure.

Two kinds. The latent families (deepseek_v3, glm4_moe_lite, mistral4; with DeepSeek sparse attention (DSA)
deepseek_v32 and glm_moe_dsa) cache the normed KV latent (kv_lora_rank) as keys and the rotated positional key
(qk_rope_head_dim) as values, one of each for all heads; DSA layers add a second cache, the indexer's key
(index_head_dim) with zeros as large as values (mlx-lm's Indexer writes `zeros_like(keys)`). The per-head families
(deepseek_v2, minicpm3, youtu_llm) expand the latent before caching: per head a key of qk_nope + qk_rope and a value
of v_head_dim. mlx-lm's latent attention cannot read a quantized cache (it multiplies the cached arrays itself), so
a latent cache stays in full precision whatever the node's kv_bits (latent_unquantized)."""

from __future__ import annotations

import math

LATENT = frozenset({"deepseek_v3", "glm4_moe_lite", "mistral4", "deepseek_v32", "glm_moe_dsa"})
SPARSE = frozenset({"deepseek_v32", "glm_moe_dsa"})
PER_HEAD = frozenset({"deepseek_v2", "minicpm3", "youtu_llm"})


def _kind(tc: dict) -> str | None:
    model_type = tc.get("model_type")
    if model_type in LATENT | PER_HEAD and tc.get("kv_lora_rank"):
        return model_type
    return None


def latent_unquantized(tc: dict) -> bool:
    """Whether this model's KV is an MLA latent cache (kept in full precision: see the module's doc)."""
    return _kind(tc) in LATENT


def mla_head_dim(tc: dict) -> int | None:
    """What a quantized cache's group must divide in a per-head MLA family: both the cached key's dimension
    (qk_nope + qk_rope) and the value's (one QuantizedKVCache groups both by one size); None for other models."""
    if _kind(tc) not in PER_HEAD:
        return None
    key = int(tc.get("qk_nope_head_dim", 0)) + int(tc.get("qk_rope_head_dim", 0))
    return math.gcd(key, _value_dim(tc))


def _value_dim(tc: dict) -> int:
    return int(tc.get("v_head_dim") or tc.get("hidden_size", 0) // int(tc.get("num_attention_heads", 1)))  # minicpm3


def mla_elements(tc: dict) -> tuple[int, int] | None:
    """(key elements, value elements) one layer caches a token, summed over its caches; None: not an MLA model."""
    kind = _kind(tc)
    if kind is None:
        return None
    rope = int(tc.get("qk_rope_head_dim", 0))
    if kind in PER_HEAD:
        heads = int(tc.get("num_attention_heads", 1))
        return heads * (int(tc.get("qk_nope_head_dim", 0)) + rope), heads * _value_dim(tc)
    index = int(tc.get("index_head_dim", 0)) if kind in SPARSE else 0
    return int(tc["kv_lora_rank"]) + index, rope + index
