"""Footprint estimates from files alone: safetensors headers and config.json. Nothing is loaded."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER_BYTES = 100 << 20
# Tensors mlx-lm's sanitize drops for text serving: vision/audio towers and, in Gemma 4,
# the K/V projections of KV-shared layers (their K/V come from an earlier layer).
DROPPED = re.compile(r"(vision_tower|audio_tower|multi_modal_projector|embed_vision|embed_audio|rotary_emb)")
SHARED_KV = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.")


class HeaderError(ValueError):
    """A safetensors file is truncated or its header is not valid."""


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: 8-byte little-endian length, then JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HeaderError(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise HeaderError(f"{path.name}: header length {n} is not plausible")
        data = f.read(n)
    if len(data) != n:
        raise HeaderError(f"{path.name}: header is truncated")
    try:
        header = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeaderError(f"{path.name}: header is not JSON: {e}") from None
    header.pop("__metadata__", None)
    size = path.stat().st_size
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise HeaderError(f"{path.name}: tensors end at byte {8 + n + end} but the file has {size}")
    return header


def tensor_names(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) over every safetensors file of a checkpoint."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in read_safetensors_header(f).items():
            out[name] = (t["dtype"], tuple(t["shape"]))
    return out


def text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) and text else config


def weight_bytes(model_dir: Path, config: dict, tensors: dict | None = None) -> int:
    """Bytes of the tensors mlx-lm will keep after loading this checkpoint for text generation."""
    tc = text_config(config)
    first_shared = tc.get("num_hidden_layers", 0) - (tc.get("num_kv_shared_layers") or 0)
    total = 0
    for name, (dtype, shape) in (tensors if tensors is not None else tensor_names(model_dir)).items():
        if DROPPED.search(name):
            continue
        m = SHARED_KV.search(name)
        if m and tc.get("num_kv_shared_layers") and int(m.group(1)) >= first_shared:
            continue
        total += DTYPE_BYTES.get(dtype, 4) * math.prod(shape)
    return total


@dataclass(frozen=True)
class KVShape:
    bytes_per_token_full: int  # grows with every token
    bytes_per_token_sliding: int  # grows until the window, then stays
    sliding_window: int | None

    def bytes_for(self, tokens: int) -> int:
        window = tokens if self.sliding_window is None else min(tokens, self.sliding_window)
        return self.bytes_per_token_full * tokens + self.bytes_per_token_sliding * window


def kv_shape(config: dict, dtype_bytes: int = 2) -> KVShape:
    """K and V bytes per token, per non-shared layer; sliding layers separately (they stop at the window)."""
    tc = text_config(config)
    layers = tc.get("num_hidden_layers", 0)
    heads = tc.get("num_attention_heads", 1)
    kv_heads = tc.get("num_key_value_heads") or heads
    head_dim = tc.get("head_dim") or tc.get("hidden_size", 0) // max(heads, 1)
    types = tc.get("layer_types") or ["full_attention"] * layers
    shared = tc.get("num_kv_shared_layers") or 0
    window = tc.get("sliding_window")
    full = sliding = 0
    for kind in types[: layers - shared]:
        if kind == "sliding_attention" and window:
            sliding += 2 * kv_heads * head_dim * dtype_bytes
        else:  # Gemma 4's full layers have their own head size and KV head count
            d = tc.get("global_head_dim") or head_dim
            h = tc.get("num_global_key_value_heads") or kv_heads
            full += (1 if tc.get("attention_k_eq_v") else 2) * h * d * dtype_bytes
    return KVShape(full, sliding, window if sliding else None)


def activation_bytes(config: dict, prefill_step: int, dtype_bytes: int = 4) -> int:
    """Peak scratch of one prefill chunk: hidden states, MLP intermediates, attention scores, last logits."""
    tc = text_config(config)
    hidden = tc.get("hidden_size", 0)
    inter = tc.get("intermediate_size", 4 * hidden)
    if tc.get("use_double_wide_mlp"):
        inter *= 2
    heads = tc.get("num_attention_heads", 1)
    vocab = tc.get("vocab_size") or config.get("vocab_size", 0)
    per_token = 6 * hidden + 3 * inter
    scores = heads * prefill_step * prefill_step
    return dtype_bytes * (prefill_step * per_token + scores + 2 * vocab)
