"""What loading a model needs, read from its files alone before any of its weights are: its pins checked, the KV
precision it is served with, its footprint, and its drafter's kind, path and bytes as that kind books them (a
drafter that does not pair never has its weights read). Residency admits the load against these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import logs
from ..drafters import registry
from ..drafters.kind import DrafterKind
from ..jobs import JobError
from ..memory.checkpoint import HeaderError, read_config
from ..memory.estimate import KVQuant
from ..types import Cause
from . import capability, manifest
from .capability import Capabilities
from .footprint import Footprint, estimate_footprint
from .store import StoredModel

log = logs.get("models")


@dataclass(frozen=True)
class LoadNeeds:
    footprint: Footprint
    kv_quant: KVQuant | None
    caps: Capabilities  # the target's, paired with its drafter (capability.with_drafter)
    kind: DrafterKind | None  # its drafter's kind; None: no drafter pairs
    drafter_path: Path | None  # the drafter's checkpoint (the target's own, for a head inside it)
    drafter_bytes: int  # what the drafter will hold, as its kind books it (a group's whole LM head included)
    whole_head: int  # of drafter_bytes: a node group's whole LM head, read on rank 0 (DrafterKind.group_bytes)


def kv_precision(stored: StoredModel, node_bits: int, node_group_size: int) -> KVQuant | None:
    """The KV cache precision a model is served with: its own [models.<id>] keys, else the node's."""
    bits, group = stored.kv_precision(node_bits, node_group_size)
    return KVQuant(bits, group) if bits else None


def load_needs(stored: StoredModel, path: Path, config: dict, *, kv_tokens: int, prefill_step: int, ranks: int,
               k: int, kv_bits: int, kv_group_size: int) -> LoadNeeds:
    """The needs of the model `stored` (its checkpoint at `path`, `config`), for a node of `ranks` ranks drafting
    `k` tokens a round. Raises JobError: weights_mismatch for a pin that does not hold (manifest.verify_pin),
    model_load_failed for target weights it cannot read; a drafter's unreadable header raises as its kind reads it
    (HeaderError), which Residency._load turns into model_load_failed."""
    model_id = stored.id
    if stored.sha256:
        manifest.verify_pin(model_id, path, stored.sha256)
    if stored.drafter_sha256 and stored.drafter:
        manifest.verify_pin(f"{model_id}'s drafter", Path(stored.drafter).expanduser(), stored.drafter_sha256)
    try:
        kv_quant = kv_precision(stored, kv_bits, kv_group_size)
        fp = estimate_footprint(path, config, kv_tokens=kv_tokens, prefill_step=prefill_step, ranks=ranks,
                                kv_quant=kv_quant)
    except (HeaderError, OSError) as e:
        raise JobError(Cause.MODEL_LOAD_FAILED, f"cannot read the weights of {model_id}: {e}") from None
    drafter_path = Path(stored.drafter).expanduser() if stored.drafter else None
    caps = capability.with_drafter(capability.detect(path, config), path, drafter_path, config)
    if drafter_path is None and caps.mtp_capable:
        drafter_path = path  # its own MTP head, inside its checkpoint
    if not (caps.mtp_capable or caps.draft_compatible):
        if drafter_path is not None:
            log.warning("drafter_not_paired", model=model_id, drafter=str(drafter_path), why=caps.drafter_reason)
        return LoadNeeds(fp, kv_quant, caps, None, drafter_path, 0, 0)
    kind = registry.named(caps.speculates_with)
    need = kind.footprint(drafter_path, read_config(drafter_path), k, prefill_step)
    whole_head = kind.group_bytes(drafter_path, config, ranks) if ranks > 1 else 0
    return LoadNeeds(fp, kv_quant, caps, kind, drafter_path, need + whole_head, whole_head)
