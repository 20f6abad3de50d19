"""The DFlash kind: a block drafter of its own that reads several of the target's layers and drafts a whole block a
forward (z-lab's DFlash and mlx-vlm's other block drafters, each a row of drafters.dflash.variants). Recognised,
paired and booked from config and headers (drafters.dflash.config); its model is drafters.dflash.head (or its
variant's subclass), its rounds the engine's DFlashDrafter."""

from __future__ import annotations

from pathlib import Path

from ...memory import estimate
from ...types import SpecMode
from ..kind import DrafterKind, float_bytes
from .config import check_pair, flat_config, is_dflash, weight_bytes
from .variants import BY_NAME


class DFlash(DrafterKind):
    name, tag, mode, proposer = "dflash", "dflash", SpecMode.MTP, "dflash"

    def claims(self, target: Path, drafter: Path, config: dict) -> bool:
        return is_dflash(config)

    def pair(self, target: Path, target_config: dict, drafter: Path, config: dict) -> str:
        return check_pair(target_config, drafter, config)

    def footprint(self, drafter: Path, config: dict, k: int, prefill_step: int) -> int:
        # What it holds loaded, and a prompt chunk read through its attention and MLP layers.
        return weight_bytes(drafter) + estimate.activation_bytes(flat_config(config), prefill_step,
                                                                 attention_only=True)

    def kv_shape(self, drafter: Path, config: dict) -> estimate.KVShape:
        """The context K/V of each of its layers, each row's own (a windowed drafter's: its window's)."""
        return estimate.kv_shape(flat_config(config), float_bytes(drafter))

    def load(self, model, drafter: Path, config: dict, load_model):
        from .head import load_dflash

        return load_dflash(drafter, model, BY_NAME[flat_config(config)["variant"]].head())


KIND = DFlash()
