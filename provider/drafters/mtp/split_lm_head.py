"""The target's LM head whole, for a native MTP head drafting on a node group's rank 0.

mlx-lm's tensor split gives each rank a slice of an untied LM head's vocabulary (`all-to-sharded`) and gathers
the logits in the model's own forward. Rank 0's drafter runs alone, with no collective, so it reads its logits
from a whole head: the checkpoint's own LM head tensors, read again for it (quantized as they are stored), and booked
with the drafter (`held_bytes`).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn

_PARTS = ("weight", "scales", "biases")


def booked_bytes(path: Path, config: dict, ranks: int) -> int:
    """What rank 0 will hold for a whole LM head beside its own slice, from the checkpoint's headers: the head's
    bytes where it is untied (a tensor split may cut it by vocabulary; where it does not, `held_bytes` after the
    load says 0, and the books take that)."""
    import math

    from ...memory.estimate import DTYPE_BYTES
    from ...memory.checkpoint import open_checkpoint

    text = config.get("text_config") or config
    if ranks < 2 or text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)):
        return 0
    stems: dict[str, int] = {}
    for name, (dtype, shape) in open_checkpoint(path).tensors.items():
        stem, _, part = name.rpartition(".")
        if stem.endswith("lm_head") and part in _PARTS and "mtp" not in stem:
            stems[stem] = stems.get(stem, 0) + DTYPE_BYTES.get(dtype, 4) * math.prod(shape)
    return stems[min(stems, key=len)] if stems else 0


def held_bytes(head: nn.Module | None) -> int:
    from mlx.utils import tree_flatten

    return 0 if head is None else sum(v.nbytes for _, v in tree_flatten(head.parameters()))


def is_split(layer) -> bool:
    return type(layer).__name__ in ("AllToShardedLinear", "QuantizedAllToShardedLinear")


def whole_lm_head(path: Path, model) -> nn.Module | None:
    """The LM head the group split, whole; None where this rank holds it whole already (tied, or split by
    layers). Raises ValueError when the checkpoint's tensors do not make the head the target was built with."""
    split = getattr(getattr(model, "language_model", model), "lm_head", None)
    if split is None or not is_split(split):
        return None
    tensors = _lm_head_tensors(path)
    if "weight" not in tensors:
        raise ValueError("the checkpoint has no LM head tensor to draft from")
    rows, cols = split.weight.shape
    quantized = "scales" in split
    if tensors["weight"].shape != (rows * split.group.size(), cols) or quantized != ("scales" in tensors):
        raise ValueError(f"the checkpoint's LM head {tensors['weight'].shape} is not the whole of the split one")
    if quantized:
        head = nn.QuantizedLinear(1, 1, bias=False, group_size=split.group_size, bits=split.bits)
    else:
        head = nn.Linear(1, 1, bias=False)
        tensors["weight"] = tensors["weight"].astype(split.weight.dtype)
    for part, value in tensors.items():  # set, not loaded: the (1, 1) layer only names its parts
        setattr(head, part, value)
    mx.eval(head.parameters())
    return head


def _lm_head_tensors(path: Path) -> dict[str, mx.array]:
    """`lm_head.{weight,scales,biases}` at the shortest name that has them (a vision checkpoint nests its text
    model's), never an MTP head's own."""
    found: dict[str, dict[str, mx.array]] = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, value in mx.load(str(f)).items():
            stem, _, part = name.rpartition(".")
            if stem.endswith("lm_head") and part in _PARTS and "mtp" not in stem:
                found.setdefault(stem, {})[part] = value
    return found[min(found, key=len)] if found else {}
