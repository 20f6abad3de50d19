"""The registry of drafter kinds: every kind the node speculates with, in the order they are tried (as mlx-lm keys
its models by model_type and vLLM keeps one proposer per method). The first kind that claims a drafter checkpoint is
its kind: the head inside the target's own checkpoint first, the draft model, which claims anything, last.

Adding a kind: its module (a DrafterKind instance, `KIND`), one line in KINDS, one row in
tests/test_drafter_registry.py. Adding a DFlash variant: its module and one row in drafters.dflash.variants.
"""

from __future__ import annotations

from pathlib import Path

from ..memory.checkpoint import read_config
from ..types import SpecReason
from .assistant import KIND as ASSISTANT
from .dflash.kind import KIND as DFLASH
from .draft_model import KIND as DRAFT_MODEL
from .eagle3.kind import KIND as EAGLE3
from .kind import OK, DrafterKind
from .mtp.kind import KIND as NATIVE_HEAD

KINDS: tuple[DrafterKind, ...] = (
    NATIVE_HEAD,  # the MTP head inside the target's checkpoint (the drafter path is the target's)
    DFLASH,  # DFlash block drafters and their variants
    EAGLE3,
    ASSISTANT,  # a Gemma 4 assistant
    DRAFT_MODEL,  # a smaller model of the same vocabulary: claims whatever the kinds above do not
)
_BY_NAME = {kind.name: kind for kind in KINDS}


def named(name: str) -> DrafterKind:
    """The kind called `name` (Capabilities.speculates_with, LoadedModel.drafter_kind)."""
    return _BY_NAME[name]


def kind_of(target: Path, drafter: Path, config: dict) -> DrafterKind:
    """The kind of the drafter checkpoint at `drafter` (its `config`) for the target at `target`."""
    return next(kind for kind in KINDS if kind.claims(target, drafter, config))


def pair(target: Path, target_config: dict, drafter: Path | None) -> tuple[DrafterKind, str]:
    """The kind that would draft for the target and OK, or why it cannot, from files only. `drafter` None: the
    target's own head, if it ships one; a target without one that some kind awaits (a Gemma 4 target, its
    assistant) then lacks a drafter (`no_drafter`), any other the capability (`not_mtp_capable`)."""
    if drafter is None:  # only the target's own head, never the target drafting for itself
        kind, path, config = NATIVE_HEAD, target, target_config
    else:
        path, config = drafter, read_config(drafter)
        kind = kind_of(target, path, config)
    why = kind.pair(target, target_config, path, config)
    if drafter is None and why != OK:
        awaited = any(target_config.get("model_type") in k.awaited_by for k in KINDS)
        why = SpecReason.NO_DRAFTER if awaited else SpecReason.NOT_MTP_CAPABLE
    return kind, str(why)
