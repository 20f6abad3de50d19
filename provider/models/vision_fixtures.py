"""Fixture factory for a tiny Gemma 4 vision-language checkpoint (mlx-vlm's `gemma4`) and its MTP assistant.

The checkpoint is laid out like a downloaded one: config.json (text_config + vision_config,
`audio_config: null`), model.safetensors under Hugging Face names (model.language_model.*,
model.vision_tower.*, model.embed_vision.*), a byte-level BPE tokenizer carrying Gemma 4's
multimodal special tokens, and processor_config.json, so `mlx_vlm.utils.load` builds mlx-vlm's own
Gemma4Processor and `mlx_lm.utils.load` loads the text part. Weights are random but seeded.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from provider.models.fixtures import (
    _mkdir,
    _random_weights,
    _save,
    build_tokenizer,
    gemma4_text_config,
    make_gemma4_tiny_assistant,
)

# Gemma 4's multimodal tokens, named as its tokenizer_config.json names them (`extra_special_tokens`);
# Gemma4Processor reads them as tokenizer attributes (tokenizer.image_token, tokenizer.boi_token, ...).
VLM_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "video_token": "<|video|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}

# GEMMA_TEMPLATE's turns, with content either a string or OpenAI-style parts. As in Gemma 4's own
# template, a media part renders as one placeholder (text parts trimmed); the processor expands each
# <|image|> to <|image> + n x <|image|> + <image|>, n from the image's size.
GEMMA4_VLM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] | trim }}"
    "{% elif p['type'] in ('image', 'image_url', 'input_image') %}<|image|>"
    "{% elif p['type'] in ('video', 'video_url') %}<|video|>"
    "{% elif p['type'] in ('audio', 'input_audio') %}<|audio|>{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# Gemma 4's real soft-token budgets (max_soft_tokens); the fixture defaults to the smallest.
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
# Widest patch row/column any budget can produce (max_soft_tokens x pooling 3 at 1120), so the
# position table can be far smaller than the real 10240 without ever dropping a position.
POSITION_EMBEDDING_SIZE = 3 * max(SOFT_TOKEN_BUDGETS)


def gemma4_vision_config(hidden: int = 32, soft_tokens: int = 70) -> dict:
    return {
        "model_type": "gemma4_vision",
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": hidden // 2,
        "global_head_dim": hidden // 2,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": POSITION_EMBEDDING_SIZE,
        "default_output_length": soft_tokens,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
        "use_clipped_linears": False,
        "standardize": False,
    }


def _write_processor_files(out: Path, soft_tokens: int) -> None:
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    # As in Gemma 4's instruction-tuned tokenizers, <bos> comes from the chat template only: encoding adds
    # nothing (mlx-vlm tokenizes the templated prompt with special tokens on, which would double it).
    tok_cfg |= {"bos_token": "<bos>", "add_bos_token": False, "extra_special_tokens": VLM_TOKENS,
                "processor_class": "Gemma4Processor", "padding_side": "left"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    image = {"patch_size": 16, "max_soft_tokens": soft_tokens, "pooling_kernel_size": 3, "do_resize": True,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False, "do_convert_rgb": True,
             "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "resample": 3}
    processor = {
        "processor_class": "Gemma4Processor",
        "image_seq_length": soft_tokens,
        "audio_seq_length": 750,
        "audio_ms_per_token": 40,
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", **image},
        "video_processor": {"video_processor_type": "Gemma4VideoProcessor", "patch_size": 16,
                            "max_soft_tokens": 70, "pooling_kernel_size": 3, "num_frames": 32,
                            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                            "do_normalize": False},
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))


def _vision_weights(config: dict, seed: int) -> dict[str, mx.array]:
    """Seeded random vision tower + projector from mlx-vlm's own modules, under Hugging Face names."""
    from mlx_vlm.models.gemma4.config import VisionConfig
    from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder, VisionModel

    mx.random.seed(seed)
    tower = VisionModel(VisionConfig.from_dict(config["vision_config"]))
    embed = MultimodalEmbedder(config["vision_config"]["hidden_size"], config["text_config"]["hidden_size"])
    weights = {f"model.vision_tower.{k}": v for k, v in tree_flatten(tower.parameters())}
    weights |= {f"model.embed_vision.{k}": v for k, v in tree_flatten(embed.parameters())}
    # mlx-vlm initialises the position table to ones (every position alike); make it random.
    table = "model.vision_tower.patch_embedder.position_embedding_table"
    weights[table] = mx.random.normal(weights[table].shape) * 0.5
    return weights


def make_gemma4_vlm(out: Path, soft_tokens: int = 70) -> None:
    """gemma4-tiny's text model (E2B-like) with a 2-layer Gemma 4 vision tower; at most `soft_tokens` an image."""
    if soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise ValueError(f"soft_tokens must be one of {SOFT_TOKEN_BUDGETS}")
    specials = tuple(dict.fromkeys(VLM_TOKENS.values()))
    ids = build_tokenizer(_mkdir(out), 512, GEMMA4_VLM_TEMPLATE, "<eos>", add_bos=False, extra_specials=specials)
    _write_processor_files(out, soft_tokens)
    text = gemma4_text_config(512, ids) | {
        "max_position_embeddings": 4096,  # room for an image at the largest budget (1120 soft tokens)
        # Explicit, as real checkpoints have it: mlx-lm and mlx-vlm default full layers' rotary
        # fraction differently (0.25 vs 1.0), so leaving it out would make the two loads disagree.
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
        },
    }
    tid = {k: ids[v] for k, v in VLM_TOKENS.items()}
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "vocab_size": 512,
        "text_config": text,
        "vision_config": gemma4_vision_config(soft_tokens=soft_tokens),
        "audio_config": None,
        "image_token_id": tid["image_token"],
        "boi_token_id": tid["boi_token"],
        "eoi_token_id": tid["eoi_token"],
        "video_token_id": tid["video_token"],
        "audio_token_id": tid["audio_token"],
        "boa_token_id": tid["boa_token"],
        "eoa_token_id": tid["eoa_token"],
        "vision_soft_tokens_per_image": soft_tokens,
        "vision_soft_tokens_per_video_frame": 70,
        "eos_token_id": text["eos_token_id"],
        "bos_token_id": ids["<bos>"],
        "pad_token_id": ids["<pad>"],
        "tie_word_embeddings": True,
    }
    weights = _random_weights(config, seed=1)
    hf = {k.replace("language_model.model.", "model.language_model.", 1): v for k, v in weights.items()}
    hf |= _vision_weights(config, seed=11)
    _save(out, config, hf)


def make_gemma4_vlm_assistant(out: Path, target: Path) -> None:
    """The `gemma4_assistant` drafter for gemma4-vlm: it reads only the target's text_config and tokenizer."""
    make_gemma4_tiny_assistant(out, target)


# Same shape as fixtures.FIXTURES (not registered there; the assistant needs its target built first).
VISION_FIXTURES = {
    "gemma4-vlm": lambda d: make_gemma4_vlm(d / "gemma4-vlm"),
    "gemma4-vlm-assistant": lambda d: make_gemma4_vlm_assistant(d / "gemma4-vlm-assistant", d / "gemma4-vlm"),
}
