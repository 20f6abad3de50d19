"""Resolve a model reference (local directory or Hugging Face repo id) and load it with mlx-lm."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..drafters import registry
from ..jobs import JobError
from ..memory.checkpoint import context_length, read_config
from ..types import Cause, SpecReason

@dataclass
class LoadedModel:
    id: str
    path: Path
    model: Any  # mlx.nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    load_seconds: float
    drafter: Any = None  # what its drafter kind loaded (a head, an assistant, a draft model), loaded and freed with it
    drafter_mode: str | None = None  # mtp | draft | None
    drafter_kind: str | None = None  # its drafter's kind (drafters.registry), which names the engine's proposer
    drafter_reason: str = "no_drafter"  # why there is no drafter (stable reason), or "ok"
    spec_profile: Any = None  # speculation.SpecProfile: the pair's measured costs and acceptance (auto's k)
    profile_pending: bool = False  # its costs are being measured (auto decodes plain until they are)
    # Token ids the detokenizer can decode, when the model's output is wider (a vocabulary padded past the
    # tokenizer): samplers draw below it. None: every output id decodes.
    decodable: int | None = None
    kv_shape: Any = None  # memory.estimate.KVShape of the target, from its files (set by the residency)
    kv_quant: Any = None  # memory.estimate.KVQuant of its KV caches (set by the residency); None: full precision
    identity: str = ""  # its files as they are (manifest.quick_identity): what a prefix kept on disk belongs to
    draft_kv_shape: Any = None  # the same of its drafter, as its kind books it (None: it keeps none of its own)
    act_shape: Any = None  # memory.estimate.ActivationShape: a forward's scratch (set by the residency)
    act_reserve: int = 0  # the scratch its footprint already reserves (one chunk of one row)
    vision: Any = None  # models.vision.VisionTower: the checkpoint's own image encoder, when it takes images
    hidden_tap: Any = None  # proofs.hidden_tap.HiddenTap: its final-norm hidden state, for commitments
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
    from ..proofs.hidden_tap import install

    lm.hidden_tap = install(lm.model)  # before the warm-up, whose forward tells it the hidden size
    warm_up(lm)
    lm.drafter_reason = drafting.reason
    if drafter_path is None:
        return lm, active_delta
    try:
        load_drafter(lm, drafter_path, group)
        lm.drafter_mode = drafting.mode
    except Exception as e:
        # What part of it loaded is neither served nor booked.
        lm.drafter = lm.drafter_lm_head = lm.draft_kv_shape = lm.drafter_kind = None
        lm.drafter_reason = SpecReason.NO_DRAFTER
        logs.get("models").warning("drafter_load_failed", model=model_id, error=f"{type(e).__name__}: {e}")
    return lm, active_delta


def load_drafter(lm: LoadedModel, drafter_path: Path, group=None) -> None:
    """Load the drafter at `drafter_path` (the target's own path: its head) beside the loaded target, as its kind
    loads it: the drafter, on a group's rank 0 the LM head it drafts from, and the KV each row keeps of its own."""
    config = read_config(drafter_path)
    kind = registry.kind_of(lm.path, drafter_path, config)

    def load_model(path: Path):  # a standalone checkpoint, loaded as a target is and warmed up
        draft = load(f"{lm.id}:draft", path)
        warm_up(draft)  # evaluate lazily built arrays on this (loading) thread
        return draft.model

    lm.drafter = kind.load(lm.model, drafter_path, config, load_model)
    lm.drafter_kind = kind.name
    if group is not None:
        lm.drafter_lm_head = kind.group_lm_head(lm.drafter, drafter_path, lm.model)
    lm.draft_kv_shape = kind.kv_shape(drafter_path, config)


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
