"""The MTP head Qwen3.5 and Qwen3-Next checkpoints ship beside the target (`mtp.*`, which mlx-lm's sanitize drops),
loaded here as a drafter from the target's own files.

One head step, as vLLM's Qwen3NextMTP and mlx-vlm's qwen3_5_mtp drafter run it:

    x = fc(concat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)])
    x = layers(x)    # full-attention decoder layers with a KV cache of their own
    h_next = norm(x);  logits = the target's LM head(h_next)

where the pair (token t+1, h_t) sits at position t: h_t is the target's final-norm hidden state at t, or for
draft steps after the first the head's own h_next. The layers are the family's own mlx-lm decoder layer with every
layer full attention (as mlx-vlm builds them): Qwen3.5's, which is a MoE layer (experts and a shared expert) when
the config has experts (Qwen3.5-MoE), and Qwen3-Next's. So the text-only install needs nothing beyond mlx-lm:
mlx-vlm's drafter class imports its own model zoo. The head's weights are converted as mlx-lm converts its
target's: zero-centred norms by `_hf_layout`, and a MoE layer's experts (one tensor per expert, as the published
heads ship them, or Qwen3.5-MoE's fused gate_up) stacked into SwitchGLU's by mlx-lm's own sanitize (`_experts`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .heads import finish_load, read_prefixed, target_dtype
from .nextn import NextNHead

FAMILIES = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}  # their heads share this layout (mlx-vlm: one drafter)
PREFIX = "mtp."
DEPTH_KEY = "mtp_num_hidden_layers"
# Norms stored zero-centred in Hugging Face checkpoints (weight + 1.0 applied), as mlx-lm converts the target's.
_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                  ".k_norm.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def text_args(model):
    """The target's text-model arguments (mlx-lm's TextModelArgs)."""
    return getattr(model, "language_model", model).args


def decoder_layer(args):
    """The family's mlx-lm decoder layer class, from its target's text arguments."""
    from mlx_lm.models import qwen3_5, qwen3_next

    return qwen3_next.Qwen3NextDecoderLayer if isinstance(args, qwen3_next.ModelArgs) else qwen3_5.DecoderLayer


class Qwen35MTPHead(NextNHead):
    PARTS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc")
    FINAL = "norm"

    def __init__(self, args, depth: int):
        super().__init__(args.hidden_size, args.rms_norm_eps)
        one = replace(args, num_hidden_layers=depth, full_attention_interval=1)  # layer 0: full attention
        # Index 0 for every layer, as mlx-vlm builds them (vLLM numbers them, the same for the one-layer heads
        # published): a Qwen3-Next layer is MoE by its index (decoder_sparse_step, mlp_only_layers).
        self.layers = [decoder_layer(args)(one, 0) for _ in range(depth)]

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def layer(self, x: mx.array, cache: list | None) -> mx.array:
        """A stack of full-attention layers (mtp_num_hidden_layers of them), one mask for all."""
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return x


def serves(config: dict) -> bool:
    """Every family of the layout: dense Qwen3.5, and the MoE heads of Qwen3.5-MoE and Qwen3-Next."""
    return config.get("model_type") in FAMILIES


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
    from ...memory.checkpoint import open_checkpoint

    return any("conv1d.weight" in n and shape[-1] != 1 for n, (_, shape) in open_checkpoint(path).tensors.items())


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> Qwen35MTPHead:
    """The head from the target's own checkpoint (only its `mtp.*` tensors are read), in the target's dtype."""
    config = json.loads((path / "config.json").read_text())
    head = Qwen35MTPHead(text_args(model), depth(config))
    centred = _hf_layout(path)
    weights = {name: value + 1.0 if centred and value.ndim == 1 and name.endswith(_CENTRED_NORMS) else value
               for name, value in read_prefixed(path, PREFIX).items()}
    return finish_load(head, _experts(model, weights), dtype or target_dtype(model), head.fc.weight.shape[0])


def _experts(model, weights: dict) -> dict:
    """A MoE head layer's experts in SwitchGLU's layout (`mlp.switch_mlp.*`), converted by mlx-lm's own sanitize
    of the target: the head's `layers.i.mlp.experts.*` named as the target's layer i, converted, named back.
    Qwen3.5-MoE's sanitize splits a fused `experts.gate_up_proj` (its target layers' layout); one tensor per
    expert (`experts.{e}.{gate,up,down}_proj.weight`: Qwen3-Next's layers, and both families' published heads)
    is stacked by Qwen3-Next's sanitize, which reads only the experts' count from its model. Anything else (a
    head converted already, a dense head) passes unchanged; a layout neither knows fails the strict load."""
    from mlx_lm.models import qwen3_5_moe, qwen3_next

    experts = {k: weights.pop(k) for k in list(weights) if ".mlp.experts." in k}
    if not experts:
        return weights
    if any(k.endswith(".experts.gate_up_proj") for k in experts) and isinstance(model, qwen3_5_moe.Model):
        named = model.sanitize({"model.language_model." + k: v for k, v in experts.items()})
        prefix = "language_model.model."
    else:
        args = text_args(model)
        stand_in = SimpleNamespace(args=SimpleNamespace(num_experts=args.num_experts, tie_word_embeddings=False))
        named = qwen3_next.Model.sanitize(stand_in, {"model." + k: v for k, v in experts.items()})
        prefix = "model."
    return weights | {k.removeprefix(prefix): v for k, v in named.items()}
