"""Fixture factory: `gemma4-dflash-tiny`, fixtures' tiny Gemma 4 target (6 layers: sliding and full attention,
a KV-shared tail, per-layer inputs, a 32-token window, a final softcap) and a Gemma 4 DFlash drafter beside it at
fixtures_dflash.drafter_dir(target), in the layout mlx-vlm's gemma4_dflash loads: `model_type: gemma4` with a
`dflash_config` (its get_model_type makes that gemma4_dflash) holding the target layer ids and no mask token id
(mlx-vlm's default 4, the tokenizer's <start_of_turn>), the target's final softcap, and the DFlash tensors.

The tapped layers are 2 (full attention) and 4 (a KV-shared sliding layer). The drafter is distilled for seconds as
fixtures_dflash's, its block embedded as the target embeds its input (scaled by sqrt(H)).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import make_gemma4_tiny
from .fixtures_dflash import BLOCK, _continuations, distil, drafter_dir
from .fixtures_mtp import HF_METADATA

LAYER_IDS = [2, 4]


def drafter_config(text: dict, layers: int = 2) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "final_logit_softcapping")
    return {"architectures": ["DFlashDraftModel"], "model_type": "gemma4", "num_hidden_layers": layers,
            "rope_theta": 10000.0, "tie_word_embeddings": True, "block_size": BLOCK,
            "num_target_layers": text["num_hidden_layers"], "dflash_config": {"target_layer_ids": LAYER_IDS}} \
        | {k: text[k] for k in keys}


def make_gemma4_dflash_tiny(out: Path, seed: int = 29, train: bool = True, steps: int = 80) -> None:
    """The target at `out`, its drafter at `drafter_dir(out)` (written first: `out/config.json` marks it built)."""
    from mlx_lm import load

    from .dflash import flat_config
    from .dflash_head import DFlashHead

    tmp = out.with_name(out.name + "-target")
    make_gemma4_tiny(tmp)
    model, _ = load(str(tmp))
    config = drafter_config(json.loads((tmp / "config.json").read_text())["text_config"])
    mx.random.seed(seed)
    head = DFlashHead(flat_config(config))
    if train:
        # every anchor: with fixtures_dflash's stride of 3 it learnt those positions only
        distil(model, head, _continuations(model), steps, layer_ids=LAYER_IDS, stride=1)
    drafter = drafter_dir(out)
    drafter.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(drafter / "model.safetensors"), dict(tree_flatten(head.parameters())),
                        metadata=HF_METADATA)
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
