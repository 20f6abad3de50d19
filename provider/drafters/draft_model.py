"""The draft-model kind, the registry's catch-all: any standalone LM with the target's exact vocabulary drafts k
tokens a round with caches of its own (the engine's DraftModelDrafter)."""

from __future__ import annotations

from pathlib import Path

from ..memory import estimate
from ..memory.checkpoint import open_checkpoint
from ..types import SpecMode
from .assistant import ASSISTANT_TYPES
from .kind import DrafterKind, float_bytes
from .vocabulary import same_vocabulary


class DraftModel(DrafterKind):
    name, tag, mode, proposer = "draft_model", "draft", SpecMode.DRAFT, "draft"
    group_drafts = True  # it reads only the tokens

    def claims(self, target: Path, drafter: Path, config: dict) -> bool:
        return True  # last in the registry: whatever no other kind claims is tried as a draft model

    def pair(self, target: Path, target_config: dict, drafter: Path, config: dict) -> str:
        if config.get("model_type") in ASSISTANT_TYPES:
            return "an MTP assistant is not a standalone draft model"
        return same_vocabulary(target, drafter, target_config, config)[1]

    def footprint(self, drafter: Path, config: dict, k: int, prefill_step: int) -> int:
        # It prefills the prompt like the target and keeps its own KV (counted within its activations' chunk).
        return estimate.weight_bytes(config, open_checkpoint(drafter).tensors) + \
            estimate.activation_bytes(config, prefill_step) + estimate.kv_shape(config).bytes_for(prefill_step)

    def kv_shape(self, drafter: Path, config: dict) -> estimate.KVShape:
        return estimate.kv_shape(config, float_bytes(drafter))

    def load(self, model, drafter: Path, config: dict, load_model):
        return load_model(drafter)


KIND = DraftModel()
