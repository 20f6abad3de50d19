"""The MTP heads shipped inside target checkpoints that the node drafts with: one module per head layout.

mlx-lm's sanitize drops these tensors at load; each module here reads them back from the target's own files.
A head module provides:

    FAMILIES                      the config `model_type`s whose heads it loads
    serves(config) -> bool        whether it loads this checkpoint's head (e.g. dense targets only)
    depth(config) -> int          the head's decoder layers
    head_tensors(names) -> list   which of the checkpoint's tensor names are the head's
    kv_elements(config) -> int    K and V elements a token per head layer with a cache (footprint's books)
    load_head(path, model)        the head, an `OwnHead`, in the target's dtype

An `OwnHead` maps (token t+1's embedding, the hidden at t) pairs to the hidden that the next head step takes
(`__call__`), and that hidden to what the LM head reads (`readout`); `lm_head` is the head's own output
projection where the checkpoint ships one, else None (the target's is used). provider.engine.drafters runs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import mlx.core as mx
from mlx import nn

_MODULES = ("qwen3_5_mtp", "nemotron_h_mtp", "glm4_moe_lite_mtp")


class OwnHead(nn.Module):
    lm_head = None

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
