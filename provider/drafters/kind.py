"""What every drafter kind says about itself: the one interface that capability, the loader, the books, the engine
and `provider models` ask (drafters.registry holds the kinds, in the order they are tried).

A kind decides from files only (config.json, safetensors headers, a tokenizer) until `load`, which reads weights and
imports its model code: listing models, pairing and booking never import MLX model code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..memory import estimate
from ..memory.checkpoint import dominant_float_bytes, open_checkpoint
from ..types import SpecMode

OK = "ok"  # a pair check's answer when the drafter drafts for the target; anything else says why not


class DrafterKind:
    """One kind of drafter; each is one instance, its module's `KIND`, named once in registry.KINDS.

    name      what a pair speculates with (Capabilities.speculates_with, LoadedModel.drafter_kind)
    tag       what `provider models list` prints after a model that speculates with it
    mode      SpecMode.MTP (it reads the target's own state) or SpecMode.DRAFT (a model of its own)
    proposer  which of the engine's proposers runs its rounds (engine.proposers.PROPOSERS, by this name)
    awaited_by    target model_types that speculate only with a drafter of this kind: such a target configured
                  without one lacks a drafter (`no_drafter`) rather than the capability (`not_mtp_capable`)
    group_drafts  whether a node group's rank 0 drafts with it alone: it reads only what rank 0 holds whole, the
                  tokens and the target's final hidden state (speculation.plan_group_drafter)
    """

    name: str
    tag: str
    mode: SpecMode = SpecMode.MTP
    proposer: str
    awaited_by: frozenset[str] = frozenset()
    group_drafts: bool = False

    def claims(self, target: Path, drafter: Path, config: dict) -> bool:
        """Whether the checkpoint at `drafter` (its `config`) is of this kind, for the target at `target` (the same
        path: the target's own checkpoint). Asked in registry order; the first kind that claims it is its kind."""
        raise NotImplementedError

    def pair(self, target: Path, target_config: dict, drafter: Path, config: dict) -> str:
        """OK, or why the drafter cannot draft for the target, from files only (no weights read)."""
        raise NotImplementedError

    def footprint(self, drafter: Path, config: dict, k: int, prefill_step: int) -> int:
        """What the drafter holds loaded: its weights and the activations of its largest forward."""
        raise NotImplementedError

    def kv_shape(self, drafter: Path, config: dict) -> estimate.KVShape | None:
        """Per-token KV each row keeps of its own (None: it keeps none, reading the target's)."""
        return None

    def load(self, model, drafter: Path, config: dict, load_model: Callable[[Path], Any]):
        """The drafter for the loaded target `model`, read from `drafter` (its `config`); `load_model` loads a
        standalone checkpoint with mlx-lm as the loader loads a target (warmed up), for a kind that is one."""
        raise NotImplementedError

    def group_lm_head(self, drafter_model, drafter: Path, model):
        """On a node group's rank 0: the LM head it drafts from where the group split the target's (None: its own,
        or the target's as this rank holds it)."""
        return None

    def group_bytes(self, drafter: Path, config: dict, ranks: int) -> int:
        """What `group_lm_head` will hold, from the headers (booked before the load)."""
        return 0


def float_bytes(path: Path) -> int:
    """The float width of the checkpoint at `path` (its KV and activations are computed in it)."""
    return dominant_float_bytes(open_checkpoint(path).tensors)
