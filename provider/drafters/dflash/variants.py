"""DFlash's variants as data: one row each, in the order they are tried; the first whose `recognised` holds names a
checkpoint's variant, and plain DFlash, last, takes the rest. A row says how its checkpoints are recognised, the keys
its config adds to the flat config (after DFlash's own: config.flat_config), what it checks beyond DFlash's checks,
the tensors its layers have and those it adds, how its tensor names map onto DFlash's head, the target family it
drafts for, and the head class that runs it. Every variant is served as the one `dflash` kind (dflash.kind).

Adding a variant: a module for what its config and headers say (its keys, checks, shapes), a head module when its
layers differ from DFlashHead's, and one row here (tests/test_drafter_registry.py: one row for its fixture)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from . import dflash2, dspark, gemma4_dspark, laguna
from . import muse_glimmer as muse

Check = Callable[[dict], "str | None"]
GEMMA4_MASK = 4  # mlx-vlm's Gemma4DFlashConfig default mask_token_id


def _head(module: str, name: str) -> Callable[[], type]:
    """A head class, imported when a drafter of the variant loads (MLX model code: never to pair or book one)."""
    return lambda: getattr(importlib.import_module(f"{__package__}.{module}"), name)


def names(config: dict) -> list[str]:
    """The checkpoint's architectures and model type, lowercased: what mlx-vlm's get_model_type reads a variant from."""
    return [str(a).lower() for a in config.get("architectures") or []] + [str(config.get("model_type", "")).lower()]


def _named(word: str) -> Callable[[dict], bool]:
    return lambda config: any(word in n for n in names(config))


def _gemma4_mask(config: dict, flat: dict) -> None:
    flat.setdefault("mask_token_id", GEMMA4_MASK)


@dataclass(frozen=True)
class Variant:
    name: str  # flat["variant"]
    recognised: Callable[[dict], bool]  # from the config alone, tried in table order
    keys: tuple[Callable[[dict, dict], None], ...] = ()  # (config, flat): its keys into the flat config, in order
    checks: tuple[Check, ...] = ()  # flat -> why it drafts otherwise than the node runs it, or None
    layers: Callable[[dict], dict] | None = None  # its layers' tensors in place of DFlash's (Qwen3's)
    extra: Callable[[dict], dict] | None = None  # its tensors beyond its layers'
    rename: Callable[[str], str] | None = None  # a tensor's name (no `model.` prefix) as DFlash's head names it
    split: Callable[[dict, dict], dict] | None = None  # (flat, tensors): fused tensors split as the head loads them
    target: str | None = None  # the target model_type (prefix) it drafts for; None: any DFlash may
    called: str = ""  # how a refusal for another target names it
    model_types: tuple[str, ...] = ()  # model types that make a checkpoint a DFlash drafter with no dflash_config
    markov: bool = False  # DSpark's Markov correction of each draft position's logits (dspark_head)
    windowed: bool = False  # sliding-window layers: a context window (head.WindowedContext)
    head: Callable[[], type] = _head("head", "DFlashHead")


VARIANTS = (
    # DFlash's layers, convolved, and a candidate selector (dflash2, dflash2_head)
    Variant("dflash2", dflash2.is_dflash2, keys=(dflash2.add_keys,), checks=(dflash2.check,),
            extra=dflash2.expected_shapes, rename=dflash2.canonical, model_types=("dflash2",), head=_head("dflash2_head", "DFlash2Head")),
    # aux norms on the tapped layers, gated heads, a window and a causal block (laguna, laguna_head)
    Variant("laguna", _named("laguna"), keys=(laguna.add_keys,), checks=(laguna.check,), extra=laguna.expected_shapes,
            split=laguna.split_qkv, target="laguna", called="a laguna drafter", windowed=True,
            head=_head("laguna_head", "LagunaHead")),
    # a DSpark drafter with Gemma 4's layers, its own embedding and LM head (gemma4_dspark, gemma4_dspark_head)
    Variant("gemma4_dspark", lambda c: _named("gemma4")(c) and gemma4_dspark.is_gemma4_dspark(c),
            keys=(dspark.add_keys, gemma4_dspark.add_keys), checks=(dspark.check, dspark.check_block,
                                                                    gemma4_dspark.check),
            layers=gemma4_dspark.expected_shapes, extra=dspark.expected_shapes, target="gemma4",
            called="a Gemma 4 drafter (gemma4_dspark)", markov=True,
            head=_head("gemma4_dspark_head", "Gemma4DSparkHead")),
    # mlx-vlm's gemma4_dflash: a DFlash drafter for Gemma 4 targets, the mask token 4 by default
    Variant("gemma4_dflash", _named("gemma4"), keys=(_gemma4_mask,), target="gemma4",
            called="a Gemma 4 drafter (gemma4_dflash)"),
    # Meta's MuseGlimmer assistant: mlx-vlm's defaults, a context window, the target's output map (muse_glimmer)
    Variant("muse_glimmer", _named("muse_glimmer"), keys=(muse.add_keys,), checks=(muse.check,), rename=muse.canonical,
            target="muse_glimmer", called="a muse_glimmer drafter", model_types=(muse.MODEL_TYPE,), windowed=True),
    # DFlash's block and a low-rank Markov correction (dspark, dspark_head): named so, or by its keys
    Variant("dspark", dspark.is_dspark, keys=(dspark.add_keys,), checks=(dspark.check, dspark.check_activation,
                                                                         dspark.check_block),
            extra=dspark.expected_shapes, model_types=("dspark",), markov=True),
    Variant("dflash", lambda config: True),  # z-lab's DFlash: Qwen3 layers over the target's embedding and LM head
)
BY_NAME = {v.name: v for v in VARIANTS}


def variant_of(config: dict) -> Variant:
    return next(v for v in VARIANTS if v.recognised(config))
