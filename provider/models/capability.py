"""What a checkpoint can do, decided from config files and safetensors headers before any weights load."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..memory.estimate import text_config
from ..memory.checkpoint import HeaderError, context_length, open_checkpoint, read_config

ASSISTANT_TYPES = {"gemma4_assistant"}
OWN_HEAD, ASSISTANT, DRAFT_MODEL = "own_mtp_head", "mtp_assistant", "draft_model"  # Capabilities.speculates_with
GEMMA4_TYPES = {"gemma4", "gemma4_text"}
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
# Families whose configs declare no MTP layer although their checkpoints ship one (LongCat-Flash: vLLM assumes one
# when the key is absent). The head's tensors still decide.
UNDECLARED_MTP_LAYERS = {"longcat_flash": 1}


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
    # What it speculates with, when it can: its own MTP head (OWN_HEAD), a Gemma 4 assistant, an EAGLE-3 drafter
    # ("eagle3"), a DFlash drafter ("dflash"), or a draft model.
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
            if i + 1 < len(parts) and parts[i + 1].isdigit() and int(parts[i + 1]) >= layers:
                return True
    return False


def native_head_family(config: dict) -> bool:
    """A family whose MTP head the node loads as a drafter (drafters.mtp.heads); the rest are detected and reported."""
    from ..drafters.mtp.heads import head_module

    return head_module(config) is not None


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
    native = False
    if declared:
        try:
            native = has_mtp_tensors(list(open_checkpoint(path).tensors), config)
        except (HeaderError, OSError):
            native = False
    return Capabilities(
        family=config.get("model_type", "unknown"),
        quantization=quantization(config),
        context_length=context_length(config),
        sliding_window=tc.get("sliding_window") if "sliding_attention" in (tc.get("layer_types") or []) or
        tc.get("sliding_window_pattern") else None,
        kv_shared_layers=tc.get("num_kv_shared_layers") or 0,
        vision=images_refused(config) is None,
        is_drafter=config.get("model_type") in ASSISTANT_TYPES,
        native_mtp_heads=native,
        native_mtp_declared=declared,
    )


def vocab_size(config: dict) -> int | None:
    return text_config(config).get("vocab_size") or config.get("vocab_size")


def same_vocabulary(a: Path, b: Path, config_a: dict, config_b: dict) -> tuple[bool, str]:
    if vocab_size(config_a) != vocab_size(config_b):
        return False, f"vocab_size {vocab_size(config_b)} != target {vocab_size(config_a)}"
    ta, tb = a / "tokenizer.json", b / "tokenizer.json"
    if ta.exists() and tb.exists():
        try:
            va, vb = _tokenizer_vocab(ta), _tokenizer_vocab(tb)
        except (OSError, ValueError, AttributeError, RecursionError) as e:
            return False, f"a tokenizer.json is unreadable: {type(e).__name__}"
        if va != vb:
            return False, "tokenizer vocabularies differ"
    return True, "ok"


def _tokenizer_vocab(path: Path):
    return json.loads(path.read_text()).get("model", {}).get("vocab")


def pair_assistant(target: Path, assistant: Path, target_config: dict | None = None,
                   assistant_config: dict | None = None) -> Pairing:
    """Is `assistant` a Gemma 4 MTP drafter for `target`? Reads only config and tokenizer files."""
    tcfg = target_config if target_config is not None else read_config(target)
    acfg = assistant_config if assistant_config is not None else read_config(assistant)
    if tcfg.get("model_type") not in GEMMA4_TYPES:
        return Pairing(False, "not_mtp_capable: target is not Gemma 4")
    if acfg.get("model_type") not in ASSISTANT_TYPES:
        return Pairing(False, f"drafter model_type {acfg.get('model_type')!r} is not gemma4_assistant")
    hidden = text_config(tcfg).get("hidden_size")
    if acfg.get("backbone_hidden_size") != hidden:
        return Pairing(False, f"backbone_hidden_size {acfg.get('backbone_hidden_size')} != target hidden_size {hidden}")
    ok, why = same_vocabulary(target, assistant, tcfg, acfg)
    return Pairing(ok, why)


def pair_draft_model(target: Path, draft: Path, target_config: dict | None = None,
                     draft_config: dict | None = None) -> Pairing:
    """Is `draft` an ordinary LM with the target's exact vocabulary (usable for draft-model speculation)?"""
    tcfg = target_config if target_config is not None else read_config(target)
    dcfg = draft_config if draft_config is not None else read_config(draft)
    if dcfg.get("model_type") in ASSISTANT_TYPES:
        return Pairing(False, "an MTP assistant is not a standalone draft model")
    ok, why = same_vocabulary(target, draft, tcfg, dcfg)
    return Pairing(ok, why)


def with_drafter(caps: Capabilities, target: Path, drafter: Path | None, target_config: dict) -> Capabilities:
    """Fill mtp_capable / draft_compatible for a target given its configured or discovered drafter."""
    from dataclasses import replace

    if drafter is None:
        if caps.native_mtp_heads and native_head_family(target_config):  # its own head drafts (config + tensors)
            return replace(caps, mtp_capable=True, drafter_reason="ok", speculates_with=OWN_HEAD)
        reason = "no_drafter" if caps.family in GEMMA4_TYPES else "not_mtp_capable"
        return replace(caps, drafter_reason=reason)
    dcfg = read_config(drafter)
    from ..drafters.dflash.config import DFLASH, is_dflash
    from ..drafters.dflash.config import check_pair as dflash_check
    from ..drafters.eagle3.config import EAGLE3, check_pair, is_eagle3

    if is_dflash(dcfg):  # a DFlash drafter: drafts a block a forward from several of the target's layers
        why = dflash_check(target_config, drafter, dcfg)
        return replace(caps, mtp_capable=why == "ok", drafter_reason=why, speculates_with=DFLASH if why == "ok" else "")
    if is_eagle3(dcfg):  # an EAGLE-3 drafter: reads three of the target's layers (drafters.eagle3.config)
        why = check_pair(target_config, drafter, dcfg)
        return replace(caps, mtp_capable=why == "ok", drafter_reason=why, speculates_with=EAGLE3 if why == "ok" else "")
    if dcfg.get("model_type") in ASSISTANT_TYPES:
        p = pair_assistant(target, drafter, target_config, dcfg)
        return replace(caps, mtp_capable=p.paired, drafter_reason=p.reason,
                       speculates_with=ASSISTANT if p.paired else "")
    p = pair_draft_model(target, drafter, target_config, dcfg)
    return replace(caps, draft_compatible=p.paired, drafter_reason=p.reason,
                   speculates_with=DRAFT_MODEL if p.paired else "")
