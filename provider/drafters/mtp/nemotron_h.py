"""The MTP head Nemotron-H checkpoints ship beside the target (`mtp.*`, which mlx-lm's sanitize drops), loaded here
as a drafter from the target's own files.

The head is one prediction module of its own layer pattern (config `mtp_hybrid_override_pattern`, e.g. "*E":
attention then MoE, as mlx-vlm's nemotron_h_mtp drafter reads it); its first block carries the input fusion, its
last the output norm. One head step, as mlx-vlm's NemotronHMTPDraftModel runs it:

    x = layers[0].eh_proj(concat[layers[0].enorm(embed(token)), layers[0].hnorm(h)])
    x = blocks(x)    # each: x + mixer(norm(x)); attention blocks with a KV cache of their own
    h_next = layers[-1].final_layernorm(x);  logits = the target's LM head(h_next)

where the pair (token t+1, h_t) sits at position t: h_t is the target's final-norm hidden state at t, or the
head's own h_next for draft steps after the first. The blocks are mlx-lm's NemotronHBlock, so the text-only
install needs nothing beyond mlx-lm; the experts are stacked by the target's own sanitize, as mlx-vlm does.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .heads import OwnHead, finish_load, read_prefixed, target_dtype
from .nextn import project

FAMILIES = {"nemotron_h"}
PREFIX = "mtp."
_CHARS = {"attention": "*", "full_attention": "*", "moe": "E", "mlp": "-", "mamba": "M", "linear_attention": "M"}


def pattern(config: dict) -> list[str]:
    """The head's blocks, one character each ("*" attention, "E" MoE), as the config names them."""
    tc = config.get("text_config") or config
    chars = tc.get("mtp_hybrid_override_pattern")
    if chars is None and tc.get("mtp_layers_block_type"):
        chars = [_CHARS.get(t, "?") for t in tc["mtp_layers_block_type"]]
    return list(chars or [])


def serves(config: dict) -> bool:
    """One prediction module of attention and MoE blocks only (what mlx-vlm's drafter loads too)."""
    tc = config.get("text_config") or config
    chars = pattern(config)
    return int(tc.get("num_nextn_predict_layers") or 0) == 1 and bool(chars) and set(chars) <= {"*", "E"}


def depth(config: dict) -> int:
    """The head's blocks with a K/V cache (its attention blocks): what footprint books per token."""
    return pattern(config).count("*")


def kv_elements(config: dict) -> int:
    tc = config.get("text_config") or config
    head_dim = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    return 2 * (tc.get("num_key_value_heads") or tc["num_attention_heads"]) * head_dim


def head_tensors(names) -> list[str]:
    return [n for n in names if n.startswith(PREFIX)]


class NemotronHMTPHead(OwnHead):
    def __init__(self, args, chars: list[str]):
        super().__init__()
        from mlx_lm.models.nemotron_h import NemotronHBlock

        hidden, eps = args.hidden_size, args.layer_norm_epsilon
        self.layers = [NemotronHBlock(args, c) for c in chars]
        first, last = self.layers[0], self.layers[-1]
        first.enorm = nn.RMSNorm(hidden, eps=eps)
        first.hnorm = nn.RMSNorm(hidden, eps=eps)
        first.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        last.final_layernorm = nn.RMSNorm(hidden, eps=eps)

    def make_cache(self) -> list:
        return [KVCache() for layer in self.layers if layer.block_type == "*"]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list | None) -> mx.array:
        """embeddings, hidden [B, L, H] (pairs: token t+1's embedding, the hidden at t) -> the head's hidden
        [B, L, H] (before the LM head), the pairs' K/V appended to `cache` (None: causal over the L pairs alone)."""
        first = self.layers[0]  # its NextN parts live in its first block, as mlx-vlm's drafter names them
        x = project(first.enorm, first.hnorm, first.eh_proj, embeddings, hidden)
        caches = iter(cache or [None] * len(self.make_cache()))
        mask = create_attention_mask(x, cache[0] if cache else None)
        for layer in self.layers:
            x = layer(x, mask=mask, cache=next(caches) if layer.block_type == "*" else None)
        return self.layers[-1].final_layernorm(x)


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> NemotronHMTPHead:
    """The head from the target's own checkpoint (only its `mtp.*` tensors are read), in the target's dtype; its
    experts stacked by the target's sanitize over the head's own pattern (as mlx-vlm's drafter does)."""
    config = json.loads((path / "config.json").read_text())
    chars = pattern(config)
    args = replace(model.args, hybrid_override_pattern=chars)
    head = NemotronHMTPHead(args, chars)
    weights = {"backbone." + k: v for k, v in read_prefixed(path, PREFIX).items()}
    weights = type(model).sanitize(SimpleNamespace(args=args), weights)  # conv layout, experts stacked
    weights = {k.removeprefix("backbone."): v for k, v in weights.items()}
    # The router's correction bias stays in its own precision, as mlx-lm keeps it (cast_predicate).
    finish_load(head, weights, dtype or target_dtype(model), args.hidden_size, keep=model.cast_predicate)
    # The head embeds with the target's table (drafters.HeadDrafter reads `embed_tokens`): held outside the module
    # tree, so it is neither the head's parameter nor booked twice.
    object.__setattr__(head, "embed_tokens", model.backbone.embeddings)
    return head
