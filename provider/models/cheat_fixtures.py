"""Checkpoints a dishonest node might serve in place of the one it names, built from a real fixture by the
fixture factory's rules (provider.models.fixtures): same architecture and tokenizer, other numbers. The
verifier (provider.verification) must tell each from the original; tools/scripts/verify_campaign.py and
tests/test_verification.py use them.

- `noisy`: every weight times (1 + scale * N(0, 1)), a stand-in for a fine-tune or a tampered copy;
- `quantized`: mlx-lm's own quantization (`nn.quantize` through `mlx_lm.utils.quantize_model`), 8 or 4 bits,
  saved as mlx-lm saves a converted model;
- `layer_dropped`: one decoder layer cut out, the config told so.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _copy_tokenizer(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def _weights(src: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def _save(out: Path, config: dict, weights: dict[str, mx.array]) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def noisy(src: Path, out: Path, scale: float = 0.01, seed: int = 0) -> Path:
    _copy_tokenizer(src, out)
    key = mx.random.key(seed)
    weights = {}
    for name, w in sorted(_weights(src).items()):
        key, sub = mx.random.split(key)
        weights[name] = (w * (1 + scale * mx.random.normal(w.shape, key=sub))).astype(w.dtype) \
            if mx.issubdtype(w.dtype, mx.floating) else w
    _save(out, json.loads((src / "config.json").read_text()), weights)
    return out


def quantized(src: Path, out: Path, bits: int, group_size: int = 32) -> Path:
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(src)
    model, config = quantize_model(model, config, group_size, bits)
    _copy_tokenizer(src, out)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def layer_dropped(src: Path, out: Path, layer: int) -> Path:
    _copy_tokenizer(src, out)
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    n = text["num_hidden_layers"]
    if not 0 <= layer < n:
        raise ValueError(f"layer {layer} is not one of {n}")
    text["num_hidden_layers"] = n - 1
    if isinstance(text.get("layer_types"), list):
        del text["layer_types"][layer]
    pattern = re.compile(r"(.*\.layers\.)(\d+)(\..*)")
    per_layer = text.get("hidden_size_per_layer_input") or 0  # Gemma 4: an input slice per layer, in two tensors
    weights = {}
    for name, w in _weights(src).items():
        m = pattern.fullmatch(name)
        if m is None:
            axis = next((a for a, d in enumerate(w.shape) if per_layer and "per_layer" in name and d == n * per_layer),
                        None)
            if axis is not None:
                keep = mx.array([i for i in range(n * per_layer) if i // per_layer != layer])
                w = mx.take(w, keep, axis=axis)
            weights[name] = w
        elif int(m.group(2)) != layer:
            i = int(m.group(2))
            weights[f"{m.group(1)}{i - 1 if i > layer else i}{m.group(3)}"] = w
    _save(out, config, weights)
    return out
