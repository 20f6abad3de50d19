"""mlx-vlm's own DFlash speculative generation on an mlx-lm target (Qwen3, or any with model.embed_tokens / layers /
norm; Gemma 4 through TapCaptureTarget): the baseline bench_mtp_families.py measures the node's DFlash drafter
against (`--fixture qwen3-dflash-tiny`, `gemma4-dflash-tiny`: mlx-vlm's Gemma4DFlashDraftModel), its DSpark
drafter (`--fixture qwen3-dspark-tiny`: mlx-vlm's DSparkDraftModel, as its get_model_type decides) and its DFlash2
drafter (`--fixture qwen3-dflash2-tiny`: DFlash2DraftModel; its greedy drafts go through its candidate selector, as
CaptureTarget offers no speculative_argmax_from_hidden, which would skip it) and a Gemma 4 DSpark drafter (`--fixture
gemma4-dspark-tiny`: Gemma4DSparkDraftModel, its own embedding and LM head kept by its bind) and a MuseGlimmer
assistant (`--fixture muse_glimmer-dflash-tiny`: MuseGlimmerAssistantDraftModel on mlx-lm's Muse Glimmer, tapped) and a
Laguna DFlash drafter (`--fixture laguna-dflash-tiny`: LagunaDFlashDraftModel on mlx-lm's Laguna, tapped).

mlx-vlm runs DFlash on targets of its own model zoo that capture layers; capture_target's `CaptureTarget` lets its
round loop (`_dflash_rounds`) drive mlx-lm's model as it drives those: the outputs of the captured layers
(target_layer_ids) beside the logits, and the rollback it calls after each verify. The loop, the drafter (mlx-vlm's
DFlashDraftModel on the checkpoint's weights, bound to the target's embedding and LM head) and its first context
(the prompt's captured layers) are mlx-vlm's own. The block is held at k + 1 (`prefer_requested_block_size`): its
adaptive block size would otherwise move k, and the comparison is at the same k.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import mlx.core as mx

from tools.bench.capture_target import CaptureTarget, TapCaptureTarget, argmax, timed


def load_drafter(drafter: Path, target: CaptureTarget):
    """mlx-vlm's DFlashDraftModel (DSparkDraftModel, DFlash2DraftModel for those checkpoints) on the checkpoint's
    weights, bound to the target."""
    import importlib

    from mlx_vlm.utils import get_model_type

    config = json.loads((drafter / "config.json").read_text())
    # as mlx-vlm's loader picks it: qwen3_dflash, dspark, dflash2, gemma4_dflash (model_type gemma4 + dflash_config)
    family = importlib.import_module(f"mlx_vlm.speculative.drafters.{get_model_type(config)}")
    model = family.Model(family.ModelConfig.from_dict(config))
    weights = {}
    for f in sorted(drafter.glob("*.safetensors")):
        weights |= dict(mx.load(str(f)))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    if not all(hasattr(layer.self_attn, "v_proj") for layer in model.layers):
        # A Gemma 4 DSpark drafter with keys as values: mlx-vlm 0.7.10's fused context projection reads the v_proj
        # such a layer has not (AttributeError); None sends it down its own per-layer path, which computes the same.
        model._project_context_kv = lambda ctx: None
    if type(model).__name__ in ("MuseGlimmerAssistantDraftModel", "LagunaDFlashDraftModel"):
        # Their binds (called again by each reset) check that the target is mlx-vlm's own Muse or Laguna class, which
        # an mlx-lm model is not; bound as they bind otherwise: the target's raw embedding table and its LM head.
        def bind(target, model=model, **_):  # Laguna's reset passes its tokenizer
            model.embed_tokens, model.lm_head = target.model.embed_tokens, target.lm_head
            return model

        model.bind = bind
    model.bind(target)
    model.prefer_requested_block_size = True  # DSpark's confidence-driven adaptive size too
    return model


def runs(path: Path, drafter: Path, ps: list[list[int]], n: int, k: int) -> tuple[list[list[int]], int, int, float]:
    """(outputs, tokens delivered, target forwards, wall seconds): greedy, k drafts a round (block k + 1)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.speculative.dflash import _dflash_rounds

    model, _ = load(str(path))
    config = json.loads((drafter / "config.json").read_text())
    ids = list((config.get("dflash_config") or {}).get("target_layer_ids") or config["target_layer_ids"])
    # stepped layer by layer from outside where that is the target's forward (Qwen3); else run whole, layers tapped
    target = CaptureTarget(model) if getattr(model, "model_type", None) == "qwen3" else TapCaptureTarget(model, ids)
    draft = load_drafter(drafter, target)
    assert list(draft.config.target_layer_ids) == ids

    def one(p: list[int]) -> list[int]:
        cache = make_prompt_cache(model)
        out = target(mx.array([p]), cache, capture_layer_ids=ids)
        first = int(argmax(out.logits[:, -1]).item())
        rounds = _dflash_rounds(target, draft, cache, mx.concatenate(out.hidden_states, axis=-1),
                                first_bonus=first, max_tokens=n, sampler=argmax, draft_block_size=k + 1,
                                greedy_sampling=True)
        return [first] + [int(t) for t, _ in itertools.islice(rounds, n - 1)]

    return timed(target, one, ps)
