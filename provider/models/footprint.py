"""What a model will hold in the budget, estimated from its files before any weights are read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..memory import estimate
from ..types import SpecMode
from ..drafters.dflash import config as dflash
from ..drafters.eagle3 import config as eagle3
from .capability import images_refused, native_head_family
from ..memory.checkpoint import context_length, open_checkpoint
from ..drafters.dflash.config import is_dflash
from ..drafters.eagle3.config import is_eagle3
from ..drafters.mtp.heads import head_module


@dataclass(frozen=True)
class Footprint:
    weights: int
    kv: int  # one sequence of kv_reserve_tokens (sliding layers capped at their window): the load gate
    activations: int
    kv_shape: estimate.KVShape  # per-token KV, from which each batch's KV is booked
    act_shape: estimate.ActivationShape  # scratch per token read, from which a batch's prefill peak is booked

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations


def estimate_footprint(path: Path, config: dict, *, kv_tokens: int, prefill_step: int, ranks: int = 1,
                       kv_quant: estimate.KVQuant | None = None) -> Footprint:
    """What loading the model will hold; in a node group of `ranks`, what one rank will (no vision tower)."""
    tensors = open_checkpoint(path).tensors
    weights = estimate.weight_bytes(config, tensors, with_vision=images_refused(config) is None) if ranks == 1 \
        else estimate.rank_weight_bytes(config, tensors, ranks)
    dtype_bytes = _dominant_float_bytes(tensors)
    tokens = min(kv_tokens, context_length(config))
    shape = estimate.kv_shape(config, dtype_bytes, kv_quant).per_rank(ranks)
    return Footprint(weights, shape.bytes_for(tokens), estimate.activation_bytes(config, prefill_step), shape,
                     estimate.activation_shape(config))


def drafter_footprint(path: Path, config: dict, mode: SpecMode, k: int, prefill_step: int) -> int:
    """Drafter weights plus its activations: the assistant works k+1 positions at a time; a draft model
    prefills the prompt like the target and keeps its own KV (counted within its activations' chunk)."""
    if mode is SpecMode.MTP and is_dflash(config):  # a DFlash drafter: what it holds loaded; it reads prompt chunks
        return dflash.weight_bytes(path) + estimate.activation_bytes(dflash.flat_config(config), prefill_step,
                                                                     attention_only=True)
    if mode is SpecMode.MTP and is_eagle3(config):  # an EAGLE-3 drafter: what it holds loaded; it reads prompt chunks
        return eagle3.weight_bytes(path) + estimate.activation_bytes(eagle3.flat_config(config), prefill_step,
                                                                     attention_only=True)
    if mode is SpecMode.MTP and native_head_family(config):  # the head inside the target's checkpoint
        tensors = open_checkpoint(path).tensors
        head = {n: tensors[n] for n in head_module(config).head_tensors(tensors)}
        weights = sum(estimate.DTYPE_BYTES.get(dtype, 4) * math.prod(shape) for dtype, shape in head.values())
        # It reads prompt chunks with the target, through attention and MLP layers only: no recurrent scan.
        return weights + estimate.activation_bytes(config, prefill_step, attention_only=True)
    weights = estimate.weight_bytes(config, open_checkpoint(path).tensors)
    if mode is SpecMode.MTP:
        return weights + estimate.activation_bytes(config, k + 1)
    return weights + estimate.activation_bytes(config, prefill_step) + estimate.kv_shape(config).bytes_for(
        prefill_step)


def head_kv_shape(path: Path, config: dict) -> estimate.KVShape:
    """Per-token KV of a native MTP head: its attention layers, each row's own (drafters.mtp.heads)."""
    module = head_module(config)
    elements = module.depth(config) * module.kv_elements(config)
    return estimate.KVShape(elements * _dominant_float_bytes(open_checkpoint(path).tensors), 0, None)


def eagle3_kv_shape(path: Path, config: dict) -> estimate.KVShape:
    """Per-token KV of an EAGLE-3 drafter (its one attention layer), each row's own."""
    return estimate.kv_shape(eagle3.flat_config(config), _dominant_float_bytes(open_checkpoint(path).tensors))


def dflash_kv_shape(path: Path, config: dict) -> estimate.KVShape:
    """Per-token KV of a DFlash drafter: the context K/V of each of its layers, each row's own."""
    return estimate.kv_shape(dflash.flat_config(config), _dominant_float_bytes(open_checkpoint(path).tensors))


def kv_shape_of(path: Path, config: dict, kv_quant: estimate.KVQuant | None = None) -> estimate.KVShape:
    """Per-token KV of a checkpoint, in the float width its weights (and so its activations) use."""
    return estimate.kv_shape(config, _dominant_float_bytes(open_checkpoint(path).tensors), kv_quant)


def _dominant_float_bytes(tensors: dict) -> int:
    sizes: dict[int, int] = {}
    for dtype, _shape in tensors.values():
        if dtype in ("F32", "F16", "BF16"):
            n = estimate.DTYPE_BYTES[dtype]
            sizes[n] = sizes.get(n, 0) + 1
    return max(sizes, key=sizes.get) if sizes else 2
