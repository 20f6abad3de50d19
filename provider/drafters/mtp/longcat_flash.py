"""The MTP layer Meituan LongCat-Flash checkpoints ship beside the target (`model.mtp.*`, which mlx-lm's longcat_flash
sanitize drops), loaded here as a drafter from the target's own files.

One head step, as vLLM's LongCatMultiTokenPredictorLayer (longcat_flash_mtp.py) and SGLang's LongcatFlashModelNextN
(longcat_flash_nextn.py) run it:

    x = eh_proj(concat[enorm(embed(token)), hnorm(h)])     # the embedding first; embed: the layer's own embed_tokens
    x = x + MLA(input_layernorm(x));  x = x + MLP(post_attention_layernorm(x))     # one dense layer, no MoE
    h_next = final_layernorm(x);  logits = the target's LM head(h_next)

where the pair (token t+1, h_t) sits at position t (no position is masked): h_t is the target's final-norm hidden
at t, or for draft steps after the first the head's own h_next (both return the normed state and feed it back).
Published names: `model.mtp.embed_tokens.weight`, `model.mtp.layers.0.{eh_proj,enorm.m,hnorm.m}.weight`,
`model.mtp.layers.0.{input_layernorm,post_attention_layernorm}.weight`, `model.mtp.layers.0.self_attn.*` (one MLA:
q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, their norms, o_proj), `model.mtp.layers.0.transformer_layer.mlp.*`
(gate/up/down of width ffn_hidden_size), `model.mtp.norm.weight`; no LM head (the target's is used). The MLA is
mlx-lm's LongcatFlashMLA (the target's, mla_scale_{q,kv}_lora included, which vLLM and SGLang fold into the
norms), its kv_b_proj split by mlx-lm's own sanitize; the MLP mlx-lm's LongcatFlashMLP. A layer shipping no
embed_tokens embeds with the target's. The node serves the first MTP layer num_nextn_predict_layers declares and
reads and books it alone (vLLM assumes one where the key is absent; the node, as for every family, requires it).
mlx-vlm 0.7.10 has no LongCat drafter.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask

from .heads import finish_load, read_prefixed, target_dtype
from .nextn import NextNHead

FAMILIES = {"longcat_flash"}
DEPTH_KEY = "num_nextn_predict_layers"
PREFIX = "model.mtp."
_FIRST = ("embed_tokens.", "norm.", "layers.0.")
# published name (after `model.mtp.`) -> the head's, first match wins
_RENAMES = (("layers.0.enorm.m.", "enorm."), ("layers.0.hnorm.m.", "hnorm."),
            ("layers.0.transformer_layer.mlp.", "mlp."), ("layers.0.", ""), ("norm.", "final_layernorm."))


class LongcatFlashMTPHead(NextNHead):
    """Its layer's parts sit on the head itself (as published), not in a block: `layer` runs them. Its cache's keys
    hold the normed latent, its values the rotated k_pe (as the target's MLA caches)."""

    def __init__(self, args, own_embedding: bool = True):
        from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP

        hidden, eps = args.hidden_size, args.rms_norm_eps
        super().__init__(hidden, eps, vocab=args.vocab_size if own_embedding else None)
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.self_attn = LongcatFlashMLA(args)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = LongcatFlashMLP(args)

    def layer(self, x: mx.array, cache: list | None) -> mx.array:
        c = cache[0] if cache else None
        mask = create_attention_mask(x, c, return_array=True)  # MLA masks its scores: an array
        x = x + self.self_attn(self.input_layernorm(x), mask, c)
        return x + self.mlp(self.post_attention_layernorm(x))


def serves(config: dict) -> bool:
    return config.get("model_type") in FAMILIES and depth(config) == 1


def depth(config: dict) -> int:
    """The head's decoder layers the node loads: the first MTP layer, if any is declared (capability.detect reads
    the same key; vLLM assumes one when it is absent)."""
    return min(int(config.get(DEPTH_KEY, 1) or 0), 1)


def kv_elements(config: dict) -> int:
    """K and V elements a token: the normed latent and the rotated k_pe, one MLA's."""
    return int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])


def head_tensors(names) -> list[str]:
    """The first MTP layer's tensors: `model.mtp.*` but the other layers' (`model.mtp.layers.<k>.`, k > 0)."""
    return [n for n in names if n.startswith(PREFIX) and n[len(PREFIX):].startswith(_FIRST)]


def _renamed(name: str) -> str:
    for published, ours in _RENAMES:
        if name.startswith(published):
            return ours + name[len(published):]
    return name


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> LongcatFlashMTPHead:
    """The head from the target's own checkpoint (only the first MTP layer's `model.mtp.*` is read), in the
    target's dtype; MLA's kv_b_proj split into embed_q / unembed_out by mlx-lm's longcat_flash sanitize."""
    from mlx_lm.models.longcat_flash import Model

    weights = {_renamed(k): v for k, v in read_prefixed(path, PREFIX).items() if k.startswith(_FIRST)}
    attn = "model.layers.0.self_attn.0."  # where the sanitize looks for it (the target's first attention)
    ctx = SimpleNamespace(args=replace(model.args, num_layers=1))  # the sanitize reads only self.args
    split = Model.sanitize(ctx, {attn + k[len("self_attn."):]: weights.pop(k) for k in list(weights)
                                 if k.startswith("self_attn.")})
    weights |= {"self_attn." + k[len(attn):]: v for k, v in split.items()}
    head = LongcatFlashMTPHead(model.args, own_embedding="embed_tokens.weight" in weights)
    return finish_load(head, weights, dtype or target_dtype(model), model.args.hidden_size)
