"""What a model will hold in the budget, estimated from its files before any weights are read. A drafter's share
is its kind's to say (provider.drafters.registry: each kind's footprint and per-row KV)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..memory import estimate
from ..memory.checkpoint import context_length, dominant_float_bytes, open_checkpoint
from .capability import images_refused


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
    dtype_bytes = dominant_float_bytes(tensors)
    tokens = min(kv_tokens, context_length(config))
    shape = estimate.kv_shape(config, dtype_bytes, kv_quant).per_rank(ranks)
    return Footprint(weights, shape.bytes_for(tokens), estimate.activation_bytes(config, prefill_step), shape,
                     estimate.activation_shape(config))


def kv_shape_of(path: Path, config: dict, kv_quant: estimate.KVQuant | None = None) -> estimate.KVShape:
    """Per-token KV of a checkpoint, in the float width its weights (and so its activations) use."""
    return estimate.kv_shape(config, dominant_float_bytes(open_checkpoint(path).tensors), kv_quant)
