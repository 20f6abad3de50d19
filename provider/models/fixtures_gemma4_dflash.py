"""Fixture factory: `gemma4-dflash-tiny`, fixtures' tiny Gemma 4 target (6 layers: sliding and full attention,
a KV-shared tail, per-layer inputs, a 32-token window, a final softcap) and a Gemma 4 DFlash drafter beside it at
fixtures_dflash.drafter_dir(target), in the layout mlx-vlm's gemma4_dflash loads: `model_type: gemma4` with a
`dflash_config` (its get_model_type makes that gemma4_dflash) holding the target layer ids and no mask token id
(mlx-vlm's default 4, the tokenizer's <start_of_turn>), the target's final softcap, and the DFlash tensors.

The tapped layers are 2 (full attention) and 4 (a KV-shared sliding layer). The drafter is distilled for seconds as
fixtures_dflash's, its block embedded as the target embeds its input (scaled by sqrt(H)).
"""

from __future__ import annotations

from pathlib import Path

from .fixtures import make_gemma4_tiny
from .fixtures_dflash import BLOCK, build_beside

LAYER_IDS = [2, 4]


def drafter_config(text: dict, layers: int = 2) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "final_logit_softcapping")
    return {"architectures": ["DFlashDraftModel"], "model_type": "gemma4", "num_hidden_layers": layers,
            "rope_theta": 10000.0, "tie_word_embeddings": True, "block_size": BLOCK,
            "num_target_layers": text["num_hidden_layers"], "dflash_config": {"target_layer_ids": LAYER_IDS}} \
        | {k: text[k] for k in keys}


def make_gemma4_dflash_tiny(out: Path, seed: int = 29, train: bool = True, steps: int = 80) -> None:
    """The target at `out`, its drafter at `drafter_dir(out)`; distilled at every anchor (with fixtures_dflash's stride
    of 3 it learnt those positions only)."""
    from .dflash_head import DFlashHead

    build_beside(out, make_gemma4_tiny, drafter_config, DFlashHead, seed, train, steps, layer_ids=LAYER_IDS, stride=1)
