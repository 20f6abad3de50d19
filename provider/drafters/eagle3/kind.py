"""The EAGLE-3 kind: a one-layer drafter of its own that reads three of the target's layers and drafts over a
vocabulary of its own (mapped onto the target's by d2t). Recognised, paired and booked from config, headers and the
d2t table (drafters.eagle3.config); its model is drafters.eagle3.head, its rounds the engine's Eagle3Drafter."""

from __future__ import annotations

from pathlib import Path

from ...memory import estimate
from ...types import SpecMode
from ..kind import DrafterKind, float_bytes
from .config import check_pair, flat_config, is_eagle3, weight_bytes


class Eagle3(DrafterKind):
    name, tag, mode, proposer = "eagle3", "eagle3", SpecMode.MTP, "eagle3"

    def claims(self, target: Path, drafter: Path, config: dict) -> bool:
        return is_eagle3(config)

    def pair(self, target: Path, target_config: dict, drafter: Path, config: dict) -> str:
        return check_pair(target_config, drafter, config)

    def footprint(self, drafter: Path, config: dict, k: int, prefill_step: int) -> int:
        # What it holds loaded, and a prompt chunk read through its layer.
        return weight_bytes(drafter) + estimate.activation_bytes(flat_config(config), prefill_step,
                                                                 attention_only=True)

    def kv_shape(self, drafter: Path, config: dict) -> estimate.KVShape:
        """Its one attention layer's K/V, each row's own."""
        return estimate.kv_shape(flat_config(config), float_bytes(drafter))

    def load(self, model, drafter: Path, config: dict, load_model):
        from .head import load_eagle3

        return load_eagle3(drafter, model)


KIND = Eagle3()
