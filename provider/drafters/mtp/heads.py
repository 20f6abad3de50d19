"""The MTP heads shipped inside target checkpoints that the node drafts with: one module per head layout.

mlx-lm's sanitize drops these tensors at load; each module here reads them back from the target's own files.
A head module provides:

    FAMILIES                      the config `model_type`s whose heads it loads
    serves(config) -> bool        whether it loads this checkpoint's head (e.g. dense targets only)
    depth(config) -> int          the head's decoder layers
    head_tensors(names) -> list   which of the checkpoint's tensor names are the head's
    kv_elements(config) -> int    K and V elements a token per head layer with a cache (footprint's books)
    load_head(path, model)        the head, an `OwnHead`, in the target's dtype (`read_prefixed`, then the
                                  layout's own conversion, then `finish_load`)

An `OwnHead` maps (token t+1's embedding, the hidden at t) pairs to the hidden that the next head step takes
(`__call__`), and that hidden to what the LM head reads (`readout`); `lm_head` is the head's own output
projection where the checkpoint ships one, else None (the target's is used); `tap` None, or the tap a head that
reads another of the target's states (Step-3.5: its final norm's input) installed at load.
provider.engine.proposers runs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import mlx.core as mx
from mlx import nn

_MODULES = ("qwen3_5", "nemotron_h", "glm4_moe_lite", "mimo", "mimo_v2", "step3p5", "ernie4_5", "exaone_moe",
            "longcat_flash")


class OwnHead(nn.Module):
    lm_head = None
    tap = None  # a HiddenTap of its own on the target, for a head fed another state than the final norm's output

    def make_cache(self) -> list:
        raise NotImplementedError

    def readout(self, hidden: mx.array) -> mx.array:
        return hidden


def modules() -> list[ModuleType]:
    return [importlib.import_module(f"{__package__}.{name}") for name in _MODULES]


def head_module(config: dict) -> ModuleType | None:
    """The module that loads this checkpoint's head (None: the node does not draft with it)."""
    for module in modules():
        if config.get("model_type") in module.FAMILIES and module.serves(config):
            return module
    return None


def read_prefixed(path: Path, prefix: str) -> dict[str, mx.array]:
    """Every tensor of the checkpoint's shards whose name starts with `prefix`, named without it."""
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, value in mx.load(str(f)).items():
            if name.startswith(prefix):
                weights[name[len(prefix):]] = value
    return weights


def target_dtype(model) -> mx.Dtype:
    """The target's float type, read off its token embedding."""
    inner = getattr(model, "language_model", model)
    embed = inner.backbone.embeddings if hasattr(inner, "backbone") else inner.model.embed_tokens
    return getattr(embed, "scales", embed.weight).dtype  # a quantized embedding's scales carry its float type


def finish_load(head: OwnHead, weights: dict[str, mx.array], dtype: mx.Dtype, hidden_size: int,
                keep: Callable[[str], bool] = lambda name: True) -> OwnHead:
    """The head's converted `weights` cast to `dtype` (floating ones for which `keep(name)`: the rest keep their
    own precision), loaded strictly (a missing or misshaped tensor raises), evaluated, and stepped once."""
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and keep(k) else v
               for k, v in weights.items()}
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    # One step on this (loading) thread: MLX ties unevaluated arrays (RoPE tables) to the thread that made them.
    h = mx.zeros((1, 1, hidden_size), dtype=dtype)
    mx.eval(head(h, h, head.make_cache()))
    return head
