"""The Gemma 4 MTP assistant (`gemma4_assistant`) in MLX.

It has no K/V of its own: each layer is query-only and attends to the target's
K/V — sliding layers to the target's last non-shared sliding layer, full layers
to its last non-shared full layer. One draft step:

    x = pre_projection(concat[target_embed(token) * sqrt(Hb), h])
    x = layers(x) at a query position held constant for the round
    xn = norm(x);  h_next = post_projection(xn);  logits = head(xn)

where h starts as the target's final-norm hidden state of the row that produced
the last committed token, and head is the tied embedding or the centroid head.
mlx-lm's Gemma4TextModel cannot host it (it rescales input embeddings and its
KV-sharing map needs a non-shared layer), so the DecoderLayers are driven directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

# Query position of a round, relative to the committed K/V length O' (rows the target has
# for accepted tokens). transformers uses O'; vLLM and mlx-vlm use O' - 1.
QUERY_POSITION_OFFSET = 0


@dataclass(frozen=True)
class AssistantConfig:
    backbone_hidden_size: int
    num_centroids: int
    centroid_intermediate_top_k: int
    use_ordered_embeddings: bool
    text: gemma4_text.ModelArgs

    @classmethod
    def from_dict(cls, cfg: dict) -> "AssistantConfig":
        tc = dict(cfg["text_config"])
        n = tc["num_hidden_layers"]
        tc["num_kv_shared_layers"] = n  # every layer reads the target's K/V
        tc.setdefault("hidden_size_per_layer_input", 0)
        tc["final_logit_softcapping"] = None
        text = gemma4_text.ModelArgs.from_dict(tc)
        return cls(cfg["backbone_hidden_size"], cfg.get("num_centroids", 0), cfg.get("centroid_intermediate_top_k", 0),
                   bool(cfg.get("use_ordered_embeddings")), text)


class MaskedEmbedder(nn.Module):
    """Centroid head: score centroids, keep the top-k buckets of tokens, score only those tokens."""

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        self.top_k = cfg.centroid_intermediate_top_k
        self.num_centroids = cfg.num_centroids
        self.per_centroid = cfg.text.vocab_size // cfg.num_centroids
        self.vocab_size = cfg.text.vocab_size
        self.centroids = nn.Linear(cfg.text.hidden_size, cfg.num_centroids, bias=False)
        self.token_ordering = mx.zeros((cfg.text.vocab_size,), dtype=mx.int32)

    def __call__(self, x: mx.array, embed_weight: mx.array) -> mx.array:
        # x: [B, L, H]  ->  logits [B, L, V], tokens outside the chosen buckets below every chosen one.
        B, L, H = x.shape
        top = mx.argpartition(-self.centroids(x), self.top_k - 1, axis=-1)[..., : self.top_k]  # [B, L, k]
        buckets = self.token_ordering.reshape(self.num_centroids, self.per_centroid)
        chosen = buckets[top].reshape(B, L, -1)  # [B, L, k * per_centroid] token ids
        emb = embed_weight[chosen.reshape(-1)].reshape(B, L, -1, H)
        scores = (x[..., None, :] @ emb.swapaxes(-1, -2)).squeeze(-2)  # [B, L, k * per_centroid]
        floor = scores.min(axis=-1, keepdims=True) - 1.0  # per row: a row's logits never depend on its batch
        out = mx.full((B, L, self.vocab_size), floor, dtype=scores.dtype)
        return mx.put_along_axis(out, chosen, scores, axis=-1)


class Gemma4Assistant(nn.Module):
    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        self.cfg = cfg
        t = cfg.text
        self.model = _Body(t)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, t.hidden_size, bias=False)
        self.post_projection = nn.Linear(t.hidden_size, cfg.backbone_hidden_size, bias=False)
        if cfg.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(cfg)

    @property
    def layer_types(self) -> list[str]:
        return [layer.layer_type for layer in self.model.layers]

    def step(self, token_embedding: mx.array, h: mx.array, shared_kv: dict[str, tuple[mx.array, mx.array]],
             position: int | mx.array, masks: dict[str, mx.array] | None = None) -> tuple[mx.array, mx.array]:
        """One draft step. token_embedding and h: [B, 1, Hb] (the target's scaled embedding and hidden).
        shared_kv: layer type -> the target's (K, V), [B, kv_heads, N, D]; `masks`, per layer type, [B, 1, 1, N]
        (False for a row's left padding) when rows hold K/V of different lengths; `position` per row ([B]) or
        shared. Returns (logits [B, 1, V], h_next)."""
        x = self.pre_projection(mx.concatenate([token_embedding, h], axis=-1))
        masks = masks or {}
        for layer in self.model.layers:
            x, _, _ = layer(x, masks.get(layer.layer_type), None, shared_kv=shared_kv[layer.layer_type],
                            offset=position)
        xn = self.model.norm(x)
        if self.cfg.use_ordered_embeddings:
            logits = self.masked_embedding(xn, self.model.embed_tokens.weight)
        else:
            logits = self.model.embed_tokens.as_linear(xn)
        return logits, self.post_projection(xn)


class _Body(nn.Module):
    def __init__(self, t: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)  # used only as the tied LM head
        self.layers = [gemma4_text.DecoderLayer(t, i) for i in range(t.num_hidden_layers)]
        self.norm = nn.RMSNorm(t.hidden_size, eps=t.rms_norm_eps)


def load_assistant(path: Path, dtype: mx.Dtype | None = None) -> Gemma4Assistant:
    """Load a Hugging Face `gemma4_assistant` checkpoint (config and weight names as published)."""
    cfg = AssistantConfig.from_dict(json.loads((path / "config.json").read_text()))
    model = Gemma4Assistant(cfg)
    weights: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    weights.pop("lm_head.weight", None)  # tied to model.embed_tokens
    if "masked_embedding.token_ordering" in weights:
        weights["masked_embedding.token_ordering"] = weights["masked_embedding.token_ordering"].astype(mx.int32)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    warm_up(model)
    return model


def warm_up(model: Gemma4Assistant) -> None:
    """One step on dummy inputs, evaluated on the loading thread: it materializes the lazily built RoPE
    tables (MLX ties unevaluated arrays to the creating thread's stream) and compiles the kernels."""
    t = model.cfg.text
    hb = model.cfg.backbone_hidden_size
    dims = {"sliding_attention": t.head_dim, "full_attention": t.global_head_dim or t.head_dim}
    kv = {kind: (mx.zeros((1, 1, 1, d)), mx.zeros((1, 1, 1, d))) for kind, d in dims.items()}
    mx.eval(model.step(mx.zeros((1, 1, hb)), mx.zeros((1, 1, hb)), kv, 1))
