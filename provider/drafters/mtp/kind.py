"""The native-head kind: an MTP head shipped inside the target's own checkpoint, loaded as a drafter by the head
module of its layout (drafters.mtp.heads). The first kind the registry tries: the drafter is the target's files.

A target's head is found from config and headers: its config declares MTP layers and its checkpoint holds their
tensors (mlx-community conversions declare them with the tensors dropped). Heads of families no module loads are
detected and reported (Capabilities.native_mtp_heads), not drafted with."""

from __future__ import annotations

import math
from pathlib import Path

from ...memory import estimate
from ...memory.checkpoint import HeaderError, open_checkpoint
from ...memory.estimate import text_config
from ...types import SpecMode, SpecReason
from ..kind import OK, DrafterKind, float_bytes

MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
# Families whose configs declare no MTP layer although their checkpoints ship one (LongCat-Flash: vLLM assumes one
# when the key is absent). The head's tensors still decide.
UNDECLARED_MTP_LAYERS = {"longcat_flash": 1}


def declared_mtp_layers(config: dict) -> int:
    configs = (config, config.get("text_config") or {})
    for cfg in configs:
        for key in MTP_KEYS:
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    if any(key in cfg for cfg in configs for key in MTP_KEYS):
        return 0
    return UNDECLARED_MTP_LAYERS.get(text_config(config).get("model_type"), 0)


def has_mtp_tensors(names: list[str], config: dict) -> bool:
    tc = text_config(config)
    layers = tc.get("num_hidden_layers", tc.get("num_layers", 0))  # LongCat-Flash names it num_layers
    for name in names:
        if name.startswith("mtp.") or ".mtp" in name or name.startswith("model.mtp"):
            return True
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            index = parts[i + 1] if i + 1 < len(parts) else ""
            # a header's name is the checkpoint's word: int() takes no non-ASCII digit, nor 4,300 of them
            if index.isascii() and index.isdigit() and len(index) < 10 and int(index) >= layers:
                return True
    return False


def native_heads(path: Path, config: dict) -> bool:
    """Whether the checkpoint declares MTP layers and holds their tensors (an unreadable one: no)."""
    if not declared_mtp_layers(config):
        return False
    try:
        return has_mtp_tensors(list(open_checkpoint(path).tensors), config)
    except (HeaderError, OSError):
        return False


def head_module(config: dict):
    """The module of drafters.mtp.heads that loads this checkpoint's head, or None. Imported when first asked: each
    head module imports its family's mlx-lm layers."""
    from .heads import head_module

    return head_module(config)


class NativeHead(DrafterKind):
    name, tag, mode, proposer = "own_mtp_head", "mtp: own head", SpecMode.MTP, "head"
    group_drafts = True  # it reads the tokens and the final hidden state, from a whole LM head (group_lm_head)

    def claims(self, target: Path, drafter: Path, config: dict) -> bool:
        # A target named as its own drafter without a head drafts for itself as a draft model would.
        return drafter == target and native_heads(target, config)

    def pair(self, target: Path, target_config: dict, drafter: Path, config: dict) -> str:
        served = native_heads(target, target_config) and head_module(target_config) is not None
        return OK if served else SpecReason.NOT_MTP_CAPABLE

    def footprint(self, drafter: Path, config: dict, k: int, prefill_step: int) -> int:
        tensors = open_checkpoint(drafter).tensors
        head = [tensors[n] for n in head_module(config).head_tensors(tensors)]
        weights = sum(estimate.DTYPE_BYTES.get(dtype, 4) * math.prod(shape) for dtype, shape in head)
        # It reads prompt chunks with the target, through attention and MLP layers only: no recurrent scan.
        return weights + estimate.activation_bytes(config, prefill_step, attention_only=True)

    def kv_shape(self, drafter: Path, config: dict) -> estimate.KVShape:
        """Its attention layers' K/V, each row's own."""
        module = head_module(config)
        return estimate.KVShape(module.depth(config) * module.kv_elements(config) * float_bytes(drafter), 0, None)

    def load(self, model, drafter: Path, config: dict, load_model):
        return head_module(config).load_head(drafter, model)

    def group_lm_head(self, drafter_model, drafter: Path, model):
        if drafter_model.lm_head is not None:  # it ships its own
            return None
        from .split_lm_head import whole_lm_head

        return whole_lm_head(drafter, model)

    def group_bytes(self, drafter: Path, config: dict, ranks: int) -> int:
        from .split_lm_head import booked_bytes

        return booked_bytes(drafter, config, ranks)


KIND = NativeHead()
