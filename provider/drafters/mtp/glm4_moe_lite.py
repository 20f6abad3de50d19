"""The nextn (MTP) layer GLM-4.7-Flash checkpoints ship as `model.layers.<num_hidden_layers>.*` (which mlx-lm's
sanitize drops), loaded here as a drafter from the target's own files.

One head step, as SGLang's nextn model and mlx-vlm's GLM nextn drafters (glm_moe_dsa_mtp, glm5_next_mtp) run it:

    x = eh_proj(concat[enorm(embed(token)), hnorm(h)])     # embed: the layer's own embed_tokens
    x = decoder layer(x)     # MLA attention with a latent cache of its own, MoE with a shared expert
    h_next = shared_head.norm(x);  logits = shared_head.head(h_next)     # the layer's own, untied LM head

where the pair (token t+1, h_t) sits at position t: h_t is the target's final-norm hidden at t, or for draft steps
after the first the head's own h_next (after shared_head.norm, as mlx-vlm's GLM drafters and SGLang feed it back;
vLLM feeds the state before that norm). mlx-vlm 0.7.10 ships GLM-4.7-Flash's splitter and config only, no runtime
drafter: this follows its split (the layer's own embed_tokens and shared_head.head kept) and its GLM siblings' step.
The decoder layer is mlx-lm's own, and the weights go through mlx-lm's glm4_moe_lite sanitize (experts stacked,
MLA's kv_b_proj split), so the text-only install needs nothing beyond mlx-lm.

DeepSeek-V3 (`deepseek_v3`) ships its nextn layer in the same layout (`model.layers.61.*`) on the same MLA + MoE
layer: it is served the same way on mlx-lm's DeepseekV3DecoderLayer and its sanitize (which also dequantizes the
published fp8 blocks). mlx-vlm has no drafter for it to compare with.

GLM-5 (`glm_moe_dsa`) ships its nextn layer the same way (`model.layers.78.*`) on DeepSeek-V3.2's layer: MLA whose
scores DeepSeek sparse attention's indexer restricts to the index_topk positions it ranks highest (its own keys
cached beside the latent: a CacheList of two caches, as mlx-lm's deepseek_v32 target holds), and MoE. Its nextn
layer ships no embed_tokens or shared_head.head of its own: the head embeds and reads out with the target's (as
mlx-vlm's glm_moe_dsa_mtp drafter binds them); a layer that ships them uses its own. mlx-lm's glm_moe_dsa is
deepseek_v32's model, so the layer and the sanitize are deepseek_v32's.

GLM-4.5 / 4.6 / 4.7 (`glm4_moe`) ship theirs the same way (`model.layers.<num_hidden_layers>.*`, as vLLM's
glm4_moe_mtp.py loads it) on an ordinary layer: grouped-query attention (partial RoPE, optional q/k norms) with a
per-head K/V cache, and MoE with a shared expert (mlx-lm's glm4_moe DecoderLayer and sanitize). DeepSeek-V3.2
(`deepseek_v32`) ships its nextn layer at `model.layers.61.*` on the DSA layer GLM-5's runs on, with its own
embed_tokens and shared_head.head (vLLM's deepseek_mtp.py reads both): the layer's own are used.

One nextn layer only (GLM-4.7-Flash's, DeepSeek-V3's, GLM-5's): deeper stacks chain a layer per draft step, which
HeadDrafter does not.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache

from ...memory.mla import mla_elements
from .heads import finish_load, read_prefixed, target_dtype
from .nextn import NextNHead

FAMILIES = {"glm4_moe_lite", "deepseek_v3", "glm_moe_dsa", "glm4_moe", "deepseek_v32"}
# Each family's mlx-lm module holding its decoder layer and sanitize (glm_moe_dsa's model is deepseek_v32's).
_MODULE = {"glm4_moe_lite": "glm4_moe_lite", "deepseek_v3": "deepseek_v3", "glm_moe_dsa": "deepseek_v32",
           "glm4_moe": "glm4_moe", "deepseek_v32": "deepseek_v32"}
_DECODER_LAYER = {"glm4_moe_lite": "Glm4MoeLiteDecoderLayer", "deepseek_v3": "DeepseekV3DecoderLayer",
                  "glm_moe_dsa": "DeepseekV32DecoderLayer", "glm4_moe": "DecoderLayer",
                  "deepseek_v32": "DeepseekV32DecoderLayer"}
_OWN = ("embed_tokens.weight", "shared_head.head.weight")  # a nextn layer's own embedding and LM head, if shipped
DEPTH_KEY = "num_nextn_predict_layers"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_NEXTN = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.")
_KEEP_FP32 = "e_score_correction_bias"  # noaux_tc routing's correction bias stays float32 (mlx-lm's cast_predicate)


def _family(args):
    return importlib.import_module(f"mlx_lm.models.{_MODULE[args.model_type]}")


def _config(config: dict) -> dict:
    return config.get("text_config") or config


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, own: bool):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        if own:
            self.head = nn.Linear(hidden, vocab, bias=False)


class Glm4MoeLiteMTPHead(NextNHead):
    FINAL = None  # its final norm is shared_head.norm (`final`)

    def __init__(self, args, own: bool = True):
        """`own`: the layer ships its own embed_tokens and shared_head.head (else the target's are used)."""
        decoder_layer = getattr(_family(args), _DECODER_LAYER[args.model_type])
        # the layer past first_k_dense_replace: a MoE layer
        super().__init__(args.hidden_size, args.rms_norm_eps, lambda: decoder_layer(args, args.num_hidden_layers),
                         vocab=args.vocab_size if own else None)
        self.shared_head = SharedHead(args.hidden_size, args.vocab_size, args.rms_norm_eps, own)

    @property
    def lm_head(self):
        return self.shared_head.get("head")

    def make_cache(self) -> list:
        # GQA: per-head keys and values; MLA: keys hold the normed latent, values the rotated k_pe (one "head"
        # each); DSA: the indexer's keys beside
        if getattr(self.block.self_attn, "indexer", None) is not None:
            return [CacheList(KVCache(), KVCache())]
        return [KVCache()]

    def mask(self, x: mx.array, cache):
        # MLA masks its scores: an array (GQA's attention takes one too); DSA's offsets: its latent cache's
        return create_attention_mask(x, cache[0] if isinstance(cache, CacheList) else cache, return_array=True)

    def final(self, x: mx.array) -> mx.array:
        """The head's hidden after shared_head.norm: the next step's hidden, as mlx-vlm's and SGLang's feed it back."""
        return self.shared_head.norm(x)


def serves(config: dict) -> bool:
    return _config(config).get("model_type", config.get("model_type")) in FAMILIES and depth(config) == 1


def depth(config: dict) -> int:
    return int(_config(config).get(DEPTH_KEY) or 0)


def kv_elements(config: dict) -> int:
    """K and V elements a token: glm4_moe's per-head K and V (grouped-query attention); the MLA families' what the
    target's MLA layers cache (provider.memory.mla: the normed latent and the rotated k_pe, with DSA the indexer's
    key and its zero values), the head's layer being one of theirs."""
    tc = _config(config)
    tc = tc | {"model_type": tc.get("model_type", config.get("model_type"))}  # a text_config may not name it
    if tc["model_type"] == "glm4_moe":
        return 2 * int(tc["num_key_value_heads"]) * int(tc["head_dim"])
    return sum(mla_elements(tc))


def _prefix(config: dict) -> str:
    return f"model.layers.{int(_config(config)['num_hidden_layers'])}."


def head_tensors(names) -> list[str]:
    """The nextn layers' tensors: every tensor of a layer that has the nextn projection `eh_proj` (config-free, as
    footprint calls it; the layer index is num_hidden_layers in the published checkpoints)."""
    names = list(names)
    nextn = {m.group(1) for n in names if (m := _NEXTN.match(n))}
    return [n for n in names if (m := _LAYER.match(n)) and m.group(1) in nextn]


def _hf_to_head(weights: dict[str, mx.array], args) -> dict[str, mx.array]:
    """The nextn layer's tensors (renamed to layer 0) through mlx-lm's own sanitize of the family, which stacks
    the experts into switch_mlp and splits MLA's kv_b_proj into embed_q / unembed_out; then the head's names."""
    from dataclasses import replace

    ctx = SimpleNamespace(args=replace(args, num_hidden_layers=1))  # the sanitize reads only self.args
    out = {}
    for name, value in _family(args).Model.sanitize(ctx, {"model.layers.0." + k: v for k, v in weights.items()}).items():
        name = name[len("model.layers.0."):]
        top = name.split(".")[0] in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
        out[name if top else "block." + name] = value
    return out


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> Glm4MoeLiteMTPHead:
    """The head from the target's own checkpoint (only its nextn layer's tensors are read), in the target's
    dtype (the router's correction bias kept float32)."""
    config = json.loads((path / "config.json").read_text())
    args = getattr(model, "language_model", model).args
    weights = read_prefixed(path, _prefix(config))
    head = Glm4MoeLiteMTPHead(args, own=any(k in weights for k in _OWN))  # one without the other: strict load fails
    weights = _hf_to_head(weights, args)
    return finish_load(head, weights, dtype or target_dtype(model), args.hidden_size,
                       keep=lambda name: _KEEP_FP32 not in name)
