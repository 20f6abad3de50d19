"""A Gemma 4 checkpoint's vision tower and projector (mlx-vlm's own modules), loaded beside mlx-lm's text model.

mlx-lm's `gemma4` loads the language model and drops the vision weights; this loads only those weights into
mlx-vlm's `VisionModel` and `MultimodalEmbedder`, so the language model is held once (mlx-lm's) and the image
features are computed by the checkpoint's own code. Engine thread only, like every MLX call.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..memory.estimate import text_config

TOWER, PROJECTOR = "vision_tower.", "embed_vision."


class VisionTower:
    def __init__(self, tower: nn.Module, projector: nn.Module, soft_tokens_per_image: int):
        self.tower = tower
        self.projector = projector
        self.soft_tokens_per_image = soft_tokens_per_image

    def encode(self, pixels) -> mx.array:
        """One image's channel-first pixels [3, H, W] -> its soft tokens in the language model's space [n, D]."""
        return self.projector(self.tower(mx.array(pixels)[None]))[0]

    def encode_frames(self, patches, positions) -> mx.array:
        """One video's frames, as patches [F, P, D] with positions [F, P, 2] (-1: padding) -> [F x n, D]."""
        return self.projector(self.tower(mx.array(patches)[None], mx.array(positions)[None]))[0]


def load_vision(path: Path, config: dict) -> VisionTower:
    from mlx_vlm.models.gemma4.config import VisionConfig
    from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
    from mlx_vlm.models.gemma4.vision import VisionModel

    vc = VisionConfig.from_dict(config["vision_config"])
    tower = VisionModel(vc)
    projector = MultimodalEmbedder(vc.hidden_size, text_config(config)["hidden_size"], eps=vc.rms_norm_eps)
    weights = _vision_weights(path, clipped=vc.use_clipped_linears)
    for prefix, module in ((TOWER, tower), (PROJECTOR, projector)):
        own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        if not own:
            raise ValueError(f"the checkpoint has no {prefix.rstrip('.')} weights")
        _quantize_like(module, own, config)
        module.load_weights(list(own.items()), strict=True)
        module.eval()
    mx.eval(tower.parameters(), projector.parameters())
    return VisionTower(tower, projector, int(config.get("vision_soft_tokens_per_image") or vc.default_output_length))


def _vision_weights(path: Path, clipped: bool) -> dict[str, mx.array]:
    """The tower's and projector's tensors from every shard, under mlx-vlm's names (as its sanitize makes them)."""
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        for name, value in mx.load(str(shard)).items():
            key = name.removeprefix("model.")
            if not key.startswith((TOWER, PROJECTOR)) or "rotary_emb" in key:
                continue
            if not clipped and any(s in key for s in ("input_max", "input_min", "output_max", "output_min")):
                continue
            out[key] = value
    return out


def _quantize_like(module: nn.Module, weights: dict, config: dict) -> None:
    """Quantize the layers a quantized checkpoint stored quantized (their `scales` are present)."""
    q = config.get("quantization")
    if not isinstance(q, dict) or not any(k.endswith(".scales") for k in weights):
        return
    nn.quantize(module, group_size=q.get("group_size", 64), bits=q.get("bits", 4),
                class_predicate=lambda p, m: f"{p}.scales" in weights and hasattr(m, "to_quantized"))
