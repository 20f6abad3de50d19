"""Resolve a model reference (local directory or Hugging Face repo id) and load it with mlx-lm."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobs import JobError
from ..types import Cause, SpecMode, SpecReason
from ..memory.checkpoint import context_length, read_config

@dataclass
class LoadedModel:
    id: str
    path: Path
    model: Any  # mlx.nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    load_seconds: float
    drafter: Any = None  # a Gemma4Assistant, a native MTP head or a draft mlx-lm model, loaded and freed with it
    drafter_mode: str | None = None  # mtp | draft | None
    drafter_reason: str = "no_drafter"  # why there is no drafter (stable reason), or "ok"
    spec_profile: Any = None  # speculation.SpecProfile: the pair's measured costs and acceptance (auto's k)
    profile_pending: bool = False  # its costs are being measured (auto decodes plain until they are)
    # Token ids the detokenizer can decode, when the model's output is wider (a vocabulary padded past the
    # tokenizer): samplers draw below it. None: every output id decodes.
    decodable: int | None = None
    kv_shape: Any = None  # memory.estimate.KVShape of the target, from its files (set by the residency)
    kv_quant: Any = None  # memory.estimate.KVQuant of its KV caches (set by the residency); None: full precision
    identity: str = ""  # its files as they are (manifest.quick_identity): what a prefix kept on disk belongs to
    draft_kv_shape: Any = None  # the same of a draft model (an MTP assistant keeps no KV of its own)
    act_shape: Any = None  # memory.estimate.ActivationShape: a forward's scratch (set by the residency)
    act_reserve: int = 0  # the scratch its footprint already reserves (one chunk of one row)
    vision: Any = None  # models.vision.VisionTower: the checkpoint's own image encoder, when it takes images
    hidden_tap: Any = None  # verification.hidden_tap.HiddenTap: its final-norm hidden state, for commitments
    drafter_lm_head: Any = None  # on a group's rank 0: the whole LM head a head drafts from, where the group split it

    @property
    def context_length(self) -> int:
        return context_length(self.config)

    @property
    def logits_width(self) -> int:
        """The ids the model scores (its configured vocabulary)."""
        from .capability import vocab_size

        return vocab_size(self.config)


def model_id_for(source: str) -> str:
    """The public id of a model: a directory's name, or the repo id as given."""
    p = Path(source).expanduser()
    return p.name if p.exists() else source


# What preparing a prompt needs of a repo: its config and tokenizer, never its weights.
TOKENIZER_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


def resolve(source: str, *, allow_download: bool = True, patterns: list[str] | None = None) -> Path:
    """Local directory as is; a repo id from the Hugging Face cache, downloading it if allowed: the files
    mlx-lm loads a model from, or only `patterns`."""
    p = Path(source).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise JobError(Cause.MODEL_LOAD_FAILED, f"{p} has no config.json; is it a model directory?")
        return p
    if p.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise JobError(Cause.UNKNOWN_MODEL, f"model {source!r} is neither a model directory nor a repo id (org/name)")

    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    patterns = patterns or DEFAULT_ALLOW_PATTERNS
    try:
        return Path(snapshot_download(source, local_files_only=True, allow_patterns=patterns))
    except Exception:
        if not allow_download:
            raise JobError(Cause.UNKNOWN_MODEL, f"model {source!r} is not in the local Hugging Face cache") from None
    try:
        # huggingface_hub shows a progress bar and resumes partial downloads.
        return Path(snapshot_download(source, allow_patterns=patterns))
    except Exception as e:
        raise JobError(Cause.UNKNOWN_MODEL, f"cannot fetch model {source!r}: {type(e).__name__}: {e}") from None


def parameter_bytes(lm: LoadedModel) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))


def warm_up(lm: LoadedModel) -> None:
    """On Metal, two decode steps, so that its kernels compile before the first real request pays for them.
    Elsewhere nothing compiles at first use (on this CPU the steps took 0.4 s on a ~100M model, and the first
    request after them took no less): one forward of one token, which still evaluates on this (loading) thread
    the arrays a model builds lazily (MLX ties unevaluated arrays to the thread that made them) and tells the
    hidden-state tap its size."""
    import mlx.core as mx

    if not (getattr(mx, "metal", None) and mx.metal.is_available()):
        mx.eval(lm.model(mx.array([[0]])))
        return
    from mlx_lm.generate import generate_step

    for _ in zip(range(2), generate_step(mx.array([0, 1]), lm.model, max_tokens=2)):
        pass


GC_BEFORE_LOAD_BYTES = 16 << 20


def load_pair(model_id: str, path: Path, drafter_path: Path | None, drafting, group=None,
              split: str = "auto") -> tuple[LoadedModel, int]:
    """Load a target with mlx-lm and warm it up, then its drafter when the plan (`DrafterPlan`) has one.
    Returns the model and the active memory its load added (what its weights measured). A drafter that
    fails to load leaves the target serving alone, with the reason `no_drafter`."""
    import gc

    import mlx.core as mx

    from .. import logs

    # So that unrelated frees during the load do not shrink the measured delta; a process holding no arrays yet
    # (a first load) has none to free, and a full collection there costs more than the load of a small model.
    if mx.get_active_memory() > GC_BEFORE_LOAD_BYTES:
        gc.collect()
    before = mx.get_active_memory()
    lm = load(model_id, path, group, split)
    active_delta = mx.get_active_memory() - before
    from ..verification.hidden_tap import install

    lm.hidden_tap = install(lm.model)  # before the warm-up, whose forward tells it the hidden size
    warm_up(lm)
    lm.drafter_reason = drafting.reason
    if drafter_path is None:
        return lm, active_delta
    try:
        load_drafter = next(loader for mode, matches, loader in DRAFTER_KINDS
                            if (mode is None or mode is drafting.mode) and matches(lm, drafter_path))
        load_drafter(lm, drafter_path, group)
        lm.drafter_mode = drafting.mode
    except Exception as e:
        lm.drafter = lm.drafter_lm_head = None  # what part of it loaded is neither served nor booked
        lm.drafter_reason = SpecReason.NO_DRAFTER
        logs.get("models").warning("drafter_load_failed", model=model_id, error=f"{type(e).__name__}: {e}")
    return lm, active_delta


# The kinds of drafter, each a row (mode, matches(lm, drafter_path), load(lm, drafter_path, group)). The first row of
# the plan's mode (None: any) whose files match loads it: its loader sets lm.drafter and, where the drafter keeps a
# KV of its own, lm.draft_kv_shape (its books). The last row of a mode matches anything, so new kinds go above it.


def _in_target(lm: LoadedModel, drafter_path: Path) -> bool:
    return drafter_path == lm.path


def _dflash(lm: LoadedModel, drafter_path: Path) -> bool:
    from ..drafters.dflash.config import is_dflash

    return is_dflash(read_config(drafter_path))


def _eagle3(lm: LoadedModel, drafter_path: Path) -> bool:
    from ..drafters.eagle3.config import is_eagle3

    return is_eagle3(read_config(drafter_path))


def _anything(lm: LoadedModel, drafter_path: Path) -> bool:
    return True


def _load_native_head(lm: LoadedModel, drafter_path: Path, group) -> None:
    from ..drafters.mtp.heads import head_module

    lm.drafter = head_module(lm.config).load_head(drafter_path, lm.model)
    if group is not None and lm.drafter.lm_head is None:  # it drafts on rank 0 alone, from a whole LM head
        from ..drafters.mtp.split_lm_head import whole_lm_head

        lm.drafter_lm_head = whole_lm_head(drafter_path, lm.model)


def _load_dflash(lm: LoadedModel, drafter_path: Path, group) -> None:  # its books: an own context KV a row
    from ..drafters.dflash.config import flat_config
    from ..drafters.dflash.head import load_dflash
    from .footprint import dflash_kv_shape

    config = read_config(drafter_path)
    lm.drafter = load_dflash(drafter_path, lm.model, dflash_head_class(flat_config(config)["variant"]))
    lm.draft_kv_shape = dflash_kv_shape(drafter_path, config)


def dflash_head_class(variant: str | None) -> type:
    """The model class of a DFlash drafter of `variant` (drafters.dflash.config.flat_config's)."""
    from ..drafters.dflash.head import DFlashHead

    if variant == "dflash2":  # DFlash's layers, convolved, and a candidate selector (drafters.dflash.dflash2)
        from ..drafters.dflash.dflash2_head import DFlash2Head as head_class
    elif variant == "gemma4_dspark":  # Gemma 4's layers, its own embedding and LM head (drafters.dflash.gemma4_dspark)
        from ..drafters.dflash.gemma4_dspark_head import Gemma4DSparkHead as head_class
    elif variant == "laguna":  # aux norms on the tapped layers, gated heads (drafters.dflash.laguna)
        from ..drafters.dflash.laguna_head import LagunaHead as head_class
    else:
        head_class = DFlashHead  # DSpark's Markov correction and MuseGlimmer's window included
    return head_class


def _load_eagle3(lm: LoadedModel, drafter_path: Path, group) -> None:  # its books: an own KV a row, as a head's
    from ..drafters.eagle3.head import load_eagle3
    from .footprint import eagle3_kv_shape

    lm.drafter = load_eagle3(drafter_path, lm.model)
    lm.draft_kv_shape = eagle3_kv_shape(drafter_path, read_config(drafter_path))


def _load_assistant(lm: LoadedModel, drafter_path: Path, group) -> None:
    from ..drafters.gemma4_assistant import load_assistant

    lm.drafter = load_assistant(drafter_path)


def _load_draft_model(lm: LoadedModel, drafter_path: Path, group) -> None:
    draft = load(f"{lm.id}:draft", drafter_path)
    warm_up(draft)  # evaluate lazily built arrays on this (loading) thread
    lm.drafter = draft.model


DRAFTER_KINDS = (
    (SpecMode.MTP, _in_target, _load_native_head),  # the head inside the target's checkpoint
    (SpecMode.MTP, _dflash, _load_dflash),  # DFlash block drafters, DSpark and DFlash2 ones among them
    (SpecMode.MTP, _eagle3, _load_eagle3),
    (SpecMode.MTP, _anything, _load_assistant),  # a Gemma 4 assistant
    (None, _anything, _load_draft_model),  # a smaller model of the same vocabulary
)


def load(model_id: str, path: Path, group=None, split: str = "auto") -> LoadedModel:
    """Load weights and tokenizer with mlx-lm (this rank's share of them in a node group: `group`, an
    mx.distributed Group, split as `split` prefers). Any failure becomes a typed MODEL_LOAD_FAILED."""
    from mlx_lm.utils import load as mlx_load

    start = time.perf_counter()
    try:
        if group is None:
            model, tokenizer, config = mlx_load(str(path), return_config=True)
        else:
            model, tokenizer, config, split = _sharded_load(model_id, path, group, split)
    except JobError:
        raise
    except Exception as e:
        raise JobError(Cause.MODEL_LOAD_FAILED, f"cannot load {model_id} from {path}: {type(e).__name__}: {e}") from None
    lm = LoadedModel(model_id, path, model, tokenizer, config, time.perf_counter() - start)
    lm.decodable = decodable_limit(config, len(tokenizer.get_vocab()))
    lm.vision = _vision_tower(model_id, path, config) if group is None else None
    lm.load_seconds = time.perf_counter() - start
    if group is not None:
        from mlx.utils import tree_flatten

        from .. import logs

        held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        logs.get("models").info("group_share_loaded", model=model_id, rank=group.rank(), ranks=group.size(),
                                split=split, weight_bytes=held)
    return lm


def choose_split(family: str, can_tensor: bool, can_pipeline: bool, heads: int, kv_heads: int, ranks: int,
                 preference: str) -> str:
    """How a group splits a model: "tensor" (each layer's projections, two all_sums a layer: best over fast
    links, RDMA over Thunderbolt) or "pipeline" (whole layers, one hand-over per rank a step: best over Ethernet).
    `preference` is the operator's ("auto": tensor where the family shards, else pipeline). Raises ValueError
    with the reason when the model cannot be split that way."""
    tensor_ok = can_tensor and heads % ranks == 0 and kv_heads % ranks == 0
    if preference != "pipeline" and tensor_ok:
        return "tensor"
    if preference != "tensor" and can_pipeline:
        return "pipeline"
    if not (can_tensor or can_pipeline):
        raise ValueError(f"mlx-lm cannot split {family} across machines: it shards neither its layers' "
                         "projections nor its layers for this family")
    if preference == "pipeline":
        raise ValueError(f"mlx-lm cannot split {family} by layers; use group_split = \"tensor\"")
    if not can_tensor:
        raise ValueError(f"mlx-lm cannot split {family}'s layers' projections; use group_split = \"pipeline\"")
    raise ValueError(f"{heads} attention and {kv_heads} KV heads do not split evenly over {ranks} ranks; form a group "
                     "of a size that divides both" + (", or use group_split = \"pipeline\"" if can_pipeline else ""))


def _sharded_load(model_id: str, path: Path, group, preference: str):
    """mlx-lm's `sharded_load` over the group, split as `choose_split` says. Every rank takes the same branch (the
    same files and settings), so a model no rank can split is refused on all of them."""
    from mlx_lm.utils import load_model, sharded_load

    from ..memory.estimate import text_config

    probe, config = load_model(path, lazy=True, strict=False)
    tc = text_config(config)
    heads = tc.get("num_attention_heads", 0)
    try:
        split = choose_split(str(config.get("model_type")), hasattr(probe, "shard"),
                             hasattr(getattr(probe, "model", None), "pipeline"), heads,
                             tc.get("num_key_value_heads") or heads, group.size(), preference)
    except ValueError as e:
        raise JobError(Cause.MODEL_LOAD_FAILED, f"{model_id}: {e}") from None
    del probe
    if split == "pipeline" and not (path / "model.safetensors.index.json").exists():
        raise JobError(Cause.MODEL_LOAD_FAILED, f"{model_id} splits by layers across a group, which needs its "
                       "weights' index file (model.safetensors.index.json)")
    model, tokenizer, config = sharded_load(str(path), return_config=True,
                                            **{f"{split}_group": group})
    return model, tokenizer, config, split


def _vision_tower(model_id: str, path: Path, config: dict):
    """The checkpoint's vision tower, when it takes images and the vision extra is installed; text is served
    either way (an image job then gets a 400 that says why)."""
    from .capability import images_refused

    if images_refused(config) is not None:
        return None
    try:
        from .vision import load_vision

        return load_vision(path, config)
    except Exception as e:
        from .. import logs

        logs.get("models").warning("vision_tower_not_loaded", model=model_id, error=f"{type(e).__name__}: {e}")
        return None


def decodable_limit(config: dict, tokenizer_size: int) -> int | None:
    """The ids a sampler may draw when the model scores more ids than the tokenizer has."""
    from .capability import vocab_size

    width = vocab_size(config)
    return tokenizer_size if isinstance(width, int) and 0 < tokenizer_size < width else None
