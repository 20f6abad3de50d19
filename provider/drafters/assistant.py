"""The Gemma 4 assistant kind (`gemma4_assistant` checkpoints): a small model of its own that reads the target's
committed K/V and last hidden state, keeping no KV of its own (its model: drafters.gemma4_assistant)."""

from __future__ import annotations

from pathlib import Path

from ..memory import estimate
from ..memory.checkpoint import open_checkpoint
from ..memory.estimate import text_config
from ..types import SpecMode
from .kind import DrafterKind
from .vocabulary import same_vocabulary

ASSISTANT_TYPES = {"gemma4_assistant"}
GEMMA4_TYPES = {"gemma4", "gemma4_text"}


class Assistant(DrafterKind):
    name, tag, mode, proposer = "mtp_assistant", "mtp", SpecMode.MTP, "assistant"
    awaited_by = frozenset(GEMMA4_TYPES)  # a Gemma 4 target speculates with one, when the store has one

    def claims(self, target: Path, drafter: Path, config: dict) -> bool:
        return config.get("model_type") in ASSISTANT_TYPES

    def pair(self, target: Path, target_config: dict, drafter: Path, config: dict) -> str:
        """Reads only config and tokenizer files."""
        if target_config.get("model_type") not in GEMMA4_TYPES:
            return "not_mtp_capable: target is not Gemma 4"
        if config.get("model_type") not in ASSISTANT_TYPES:
            return f"drafter model_type {config.get('model_type')!r} is not gemma4_assistant"
        hidden = text_config(target_config).get("hidden_size")
        if config.get("backbone_hidden_size") != hidden:
            return f"backbone_hidden_size {config.get('backbone_hidden_size')} != target hidden_size {hidden}"
        return same_vocabulary(target, drafter, target_config, config)[1]

    def footprint(self, drafter: Path, config: dict, k: int, prefill_step: int) -> int:
        # It works k + 1 positions at a time and reads the target's KV: no prompt chunk, no KV of its own.
        return estimate.weight_bytes(config, open_checkpoint(drafter).tensors) + estimate.activation_bytes(config, k + 1)

    def load(self, model, drafter: Path, config: dict, load_model):
        from .gemma4_assistant import load_assistant

        return load_assistant(drafter)


KIND = Assistant()
