"""Fixture factory: `muse_glimmer-dflash-tiny`, a tiny Muse Glimmer target (mlx-lm's muse_glimmer: gated attention,
centred norms, three sliding layers of window 16 then a global NoPE one, an output multiplier and softcap) and a
MuseGlimmer DFlash assistant (models.muse_glimmer_assistant) beside it at fixtures_dflash.drafter_dir(target), in the
layout mlx-vlm's muse_glimmer_assistant loads: `model_type: muse_glimmer_assistant`, its DFlash keys at the top level,
two sliding-window layers of window 24 tapping the target's layers 1 and 2, `encoder.fc` / `encoder.output_norm_enc`,
tensors under `model.`.

The assistant is distilled for seconds as fixtures_dflash's, under its window (the training contexts run past it).
"""

from __future__ import annotations

from pathlib import Path

from .fixtures import CHATML_TEMPLATE, _mkdir, _random_weights, _save, build_tokenizer
from .fixtures_dflash import BLOCK, build_beside

LAYER_IDS = [1, 2]
WINDOW = 24  # the assistant's: shorter than the longer test prompts and the training sequences


def make_muse_glimmer_tiny(out: Path, **sizes) -> None:  # sizes: config keys over the tiny ones
    ids = build_tokenizer(_mkdir(out), 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)
    config = {"architectures": ["MuseGlimmerForCausalLM"], "model_type": "muse_glimmer", "hidden_size": 64,
              "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 384, "rms_norm_eps": 1e-5, "sliding_window": 16,
              "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "max_position_embeddings": 1024,
              "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "tie_word_embeddings": False,
              "eos_token_id": ids["<|im_end|>"]} | sizes
    _save(out, config, _random_weights(config, seed=13))  # its plain runs of the test prompts end no earlier than 16


def assistant_config(target: dict) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_parameters")
    return {"architectures": ["MuseGlimmerAssistantModel"], "model_type": "muse_glimmer_assistant",
            "num_hidden_layers": len(LAYER_IDS), "layer_types": ["sliding_attention"] * len(LAYER_IDS),
            "sliding_window": WINDOW, "block_size": BLOCK, "mask_token_id": target["vocab_size"] - 2,
            "target_layer_ids": LAYER_IDS, "num_target_layers": target["num_hidden_layers"]} | \
        {k: target[k] for k in keys}


def make_muse_glimmer_dflash_tiny(out: Path, seed: int = 37, train: bool = True, steps: int = 80) -> None:
    """The target at `out`, its assistant at `drafter_dir(out)`, its tensors under MuseGlimmer's names."""
    from .dflash_head import DFlashHead

    build_beside(out, make_muse_glimmer_tiny, assistant_config, DFlashHead, seed, train, steps, layer_ids=LAYER_IDS,
                 stride=1, saved=muse_names)


def muse_names(weights: dict) -> dict:
    """The head's tensors under the assistant's names: `model.`, its context projection under `encoder.`."""
    names = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
    return {"model." + next((k.replace(a, b, 1) for a, b in names.items() if k.startswith(a)), k): v
            for k, v in weights.items()}
