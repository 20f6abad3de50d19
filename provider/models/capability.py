"""What a checkpoint can do, decided from config files and safetensors headers before any weights load. What it
speculates with is the drafter kinds' to say (provider.drafters.registry)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..drafters import registry
from ..drafters.assistant import ASSISTANT_TYPES
from ..drafters.kind import OK
from ..drafters.mtp.kind import declared_mtp_layers, native_heads
from ..drafters.vocabulary import vocab_size  # noqa: F401 (what a model scores: the loader and prompts ask it here)
from ..memory.checkpoint import context_length, read_config
from ..memory.estimate import text_config
from ..types import SpecMode


@dataclass(frozen=True)
class Pairing:
    paired: bool
    reason: str  # "ok" or why not


@dataclass(frozen=True)
class Capabilities:
    family: str
    quantization: str | None  # e.g. "4-bit g64"
    context_length: int
    sliding_window: int | None
    kv_shared_layers: int
    vision: bool
    is_drafter: bool  # an assistant/drafter checkpoint: never advertised as a servable model
    native_mtp_heads: bool  # declared in config AND tensors present
    native_mtp_declared: int
    mtp_capable: bool = False  # Gemma 4 target with a validly paired assistant
    draft_compatible: bool = False  # a configured draft model with an identical vocabulary
    drafter_reason: str = "no_drafter"
    # What it speculates with, when it can: the name of its drafter's kind (drafters.registry), e.g. own_mtp_head.
    speculates_with: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def quantization(config: dict) -> str | None:
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    if "bits" in q:
        return f"{q['bits']}-bit g{q.get('group_size', '?')}"
    return str(q.get("quant_method", "quantized"))


def images_refused(config: dict) -> str | None:
    """Why this checkpoint takes no images (None: it takes them through its own vision tower)."""
    if not config.get("vision_config"):
        return "it has no vision tower"
    if config.get("model_type") != "gemma4":
        return f"images are served for Gemma 4 checkpoints only (this is {config.get('model_type')!r})"
    if text_config(config).get("use_bidirectional_attention") == "vision":
        # 26B/31B attend bidirectionally inside an image block; mlx-lm's text model masks causally only.
        return "its language model attends bidirectionally within an image, which the node does not serve yet"
    for key in ("image_token_id", "boi_token_id", "eoi_token_id"):
        if not isinstance(config.get(key), int):
            return f"its config names no {key}"
    return None


def media_token_ids(config: dict) -> frozenset[int]:
    """The ids a prompt repeats once per soft token of an image, a video frame or audio: one id for all."""
    ids = (config.get(k) for k in ("image_token_id", "video_token_id", "audio_token_id"))
    return frozenset(i for i in ids if isinstance(i, int)) if config.get("vision_config") else frozenset()


def detect(path: Path, config: dict | None = None) -> Capabilities:
    config = config if config is not None else read_config(path)
    tc = text_config(config)
    declared = declared_mtp_layers(config)
    return Capabilities(
        family=config.get("model_type", "unknown"),
        quantization=quantization(config),
        context_length=context_length(config),
        sliding_window=tc.get("sliding_window") if "sliding_attention" in (tc.get("layer_types") or []) or
        tc.get("sliding_window_pattern") else None,
        kv_shared_layers=tc.get("num_kv_shared_layers") or 0,
        vision=images_refused(config) is None,
        is_drafter=config.get("model_type") in ASSISTANT_TYPES,
        native_mtp_heads=native_heads(path, config),
        native_mtp_declared=declared,
    )


def pair_assistant(target: Path, assistant: Path, target_config: dict | None = None,
                   assistant_config: dict | None = None) -> Pairing:
    """Is `assistant` a Gemma 4 MTP drafter for `target`? Reads only config and tokenizer files."""
    return _pairing(registry.ASSISTANT, target, assistant, target_config, assistant_config)


def pair_draft_model(target: Path, draft: Path, target_config: dict | None = None,
                     draft_config: dict | None = None) -> Pairing:
    """Is `draft` an ordinary LM with the target's exact vocabulary (usable for draft-model speculation)?"""
    return _pairing(registry.DRAFT_MODEL, target, draft, target_config, draft_config)


def _pairing(kind, target: Path, drafter: Path, target_config: dict | None, config: dict | None) -> Pairing:
    why = kind.pair(target, read_config(target) if target_config is None else target_config, drafter,
                    read_config(drafter) if config is None else config)
    return Pairing(why == OK, why)


def with_drafter(caps: Capabilities, target: Path, drafter: Path | None, target_config: dict) -> Capabilities:
    """Fill mtp_capable / draft_compatible for a target given its configured or discovered drafter (None: its own
    head, if it ships one), as the kind of that drafter pairs it."""
    kind, why = registry.pair(target, target_config, drafter)
    ok = why == OK
    return replace(caps, mtp_capable=ok and kind.mode is SpecMode.MTP, draft_compatible=ok and kind.mode is
                   SpecMode.DRAFT, drafter_reason=why, speculates_with=kind.name if ok else "")
