"""The MTP layer Baidu ERNIE-4.5 MoE checkpoints ship beside the target (`model.mtp_block.0.*`, `model.mtp_emb_norm.0`,
`model.mtp_hidden_norm.0`, `model.mtp_linear_proj.0`, which mlx-lm's ernie4_5_moe sanitize drops), loaded here as a
drafter from the target's own files.

One head step, as SGLang's Ernie4ModelMTP (ernie4_eagle.py) and vLLM's ErnieMultiTokenPredictorLayer run it:

    e = embed(token), zeroed where the pair sits at position 0 (both: "masking inputs at position 0")
    x = mtp_linear_proj(concat[mtp_emb_norm(e), mtp_hidden_norm(h)])     # the embedding first; biased if use_bias
    x = mtp_block(x)     # a dense ERNIE decoder layer (SGLang: is_mtp, never MoE) with a KV cache of its own
    logits = the target's LM head(x)     # no norm between: both feed the block's output to the LM head as it is

where the pair (token t+1, h_t) sits at position t: h_t is the target's final-norm hidden at t (SGLang's Ernie4Model
returns it normed), or for draft steps after the first the head's own x. The block is mlx-lm's Ernie4_5_DecoderLayer
built past the MoE range (so dense), with the target's interleaved RoPE as SGLang's layer has it (vLLM builds a
LlamaDecoderLayer, whose RoPE is rotate-half: it disagrees with its own target there; SGLang is followed). Both run
the layer one draft token a round; the node chains it k times, as it does every one-layer head. mlx-vlm 0.7.10 has
no ERNIE drafter. A checkpoint declaring more layers is served with its first (`.0.`), the only one read and booked.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from .heads import finish_load, read_prefixed, target_dtype
from .nextn import NextNHead, at_position_zero_zeroed

FAMILIES = {"ernie4_5_moe"}
DEPTH_KEY = "num_nextn_predict_layers"
_PARTS = ("mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj", "mtp_block")
_FIRST = re.compile(r"^model\.(mtp_emb_norm|mtp_hidden_norm|mtp_linear_proj|mtp_block)\.0\.")


class Ernie45MTPHead(NextNHead):
    PARTS = ("mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj")
    BLOCK = "mtp_block"
    FINAL = None  # the block's output is what the LM head reads, and the next step's hidden

    def __init__(self, args):
        from mlx_lm.models.ernie4_5_moe import Ernie4_5_DecoderLayer, Ernie4_5_MLP

        # past the MoE layers: dense; the projection biased if use_bias
        super().__init__(args.hidden_size, args.rms_norm_eps,
                         lambda: Ernie4_5_DecoderLayer(args, args.num_hidden_layers), bias=args.use_bias)
        if not isinstance(self.mtp_block.mlp, Ernie4_5_MLP):
            raise ValueError("the MTP block would be a MoE layer (moe_layer_end_index past num_hidden_layers)")

    def masked_embeddings(self, embeddings: mx.array, cache) -> mx.array:
        return at_position_zero_zeroed(embeddings, 0 if cache is None else cache.offset)


def serves(config: dict) -> bool:
    return config.get("model_type") in FAMILIES and depth(config) == 1


def depth(config: dict) -> int:
    """The head's decoder layers the node loads: the first MTP layer, if any is declared."""
    return min(int(config.get(DEPTH_KEY) or 0), 1)


def kv_elements(config: dict) -> int:
    """K and V a token: mlx-lm's ERNIE attention (head_dim, else hidden_size / heads)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * int(config["num_key_value_heads"]) * int(head_dim)


def head_tensors(names) -> list[str]:
    """The first MTP layer's tensors (`model.mtp_*.0.*`)."""
    return [n for n in names if _FIRST.match(n)]


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> Ernie45MTPHead:
    """The head from the target's own checkpoint (only the first MTP layer's tensors are read), in the target's
    dtype."""
    weights = {}
    for part in _PARTS:
        weights |= {f"{part}.{k}": v for k, v in read_prefixed(path, f"model.{part}.0.").items()}
    return finish_load(Ernie45MTPHead(model.args), weights, dtype or target_dtype(model), model.args.hidden_size)
