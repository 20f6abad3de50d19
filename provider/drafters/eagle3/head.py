"""The EAGLE-3 drafter as a model (checkpoints: drafters.eagle3.config), built on mlx-lm's Llama classes only, so the
text-only install needs nothing else (mlx-vlm's drafter imports its own model zoo).

One step, as vLLM's / SGLang's llama_eagle3 and mlx-vlm's Eagle3DraftModel run it, for the pair (token t+1, h_t):

    g = fc(h_t)                                      # h_t: the three tapped target layers' outputs at t, [3 * H_t]
    x = attn(concat[input_layernorm(embed(t+1)), hidden_norm(g)]) + g   # (+ hidden_norm(g): norm_before_residual)
    x = x + mlp(post_attention_layernorm(x))
    logits_draft = lm_head(norm(x));  token = draft id + d2t[draft id]

For draft steps after the first the pair's hidden is the drafter's own x (already of its width: no fc). The draft
distribution is scattered onto the target's vocabulary through d2t (`target_logits`): ids outside the draft
vocabulary get the dtype's lowest logit, so their probability is exactly 0 and a sampled round stays exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .config import canonical, flat_config, tapped_layers


class Eagle3Layer(nn.Module):
    """mlx-lm's Llama attention and MLP; the attention reads 2 * hidden (embedding ++ hidden)."""

    def __init__(self, args: llama.ModelArgs, norm_before_residual: bool):
        super().__init__()
        h = args.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.self_attn = llama.Attention(args)
        a = self.self_attn
        for name, heads in (("q_proj", a.n_heads), ("k_proj", a.n_kv_heads), ("v_proj", a.n_kv_heads)):
            setattr(a, name, nn.Linear(2 * h, heads * args.head_dim, bias=args.attention_bias))
        self.mlp = llama.MLP(args)

    def __call__(self, embeds: mx.array, hidden: mx.array, mask, cache) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = residual + self.self_attn(mx.concatenate([self.input_layernorm(embeds), normed], axis=-1), mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """The drafter: `__call__` maps pairs to its hidden (what the next step takes), `readout` that hidden to what
    its LM head reads, as drafters.mtp.heads.OwnHead; `target_logits` gives logits over the target's vocabulary."""

    def __init__(self, flat: dict, own_embedding: bool):
        super().__init__()
        args = llama.ModelArgs.from_dict(flat | {"num_hidden_layers": 1})
        self.hidden_size, self.vocab_size = args.hidden_size, args.vocab_size
        self.fc = nn.Linear(3 * flat["target_hidden_size"], args.hidden_size, bias=False)
        self.layers = [Eagle3Layer(args, flat["norm_before_residual"])]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, flat["draft_vocab_size"], bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        if flat["draft_vocab_size"] != args.vocab_size:
            self.hot = mx.zeros((flat["draft_vocab_size"],), dtype=mx.int32)  # draft id -> target id
        self.tap = None  # proofs.hidden_tap.LayerTap on the target, set by load_eagle3

    def make_cache(self) -> list:
        return [KVCache()]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list | None) -> mx.array:
        """embeddings [B, L, H], hidden [B, L, 3 * H_t] (the target's) or [B, L, H] (its own) -> [B, L, H]."""
        if hidden.shape[-1] != self.hidden_size:
            hidden = self.fc(hidden)
        c = cache[0] if cache else None
        return self.layers[0](embeddings, hidden, create_attention_mask(hidden, c), c)

    def readout(self, hidden: mx.array) -> mx.array:
        return self.norm(hidden)

    def draft_logits(self, hidden: mx.array) -> mx.array:
        return self.lm_head(self.norm(hidden))

    def target_logits(self, hidden: mx.array, width: int) -> mx.array:
        """[..., H] -> [..., width]: the draft logits at their target ids, the lowest logit elsewhere."""
        draft = self.draft_logits(hidden)
        if "hot" not in self:
            return draft if draft.shape[-1] == width else mx.pad(
                draft, [(0, 0)] * (draft.ndim - 1) + [(0, width - draft.shape[-1])],
                constant_values=mx.finfo(draft.dtype).min)
        full = mx.full((*draft.shape[:-1], width), mx.finfo(draft.dtype).min, dtype=draft.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self.hot, draft.shape), draft, axis=-1)

    def to_target(self, draft_ids: mx.array) -> mx.array:
        return self.hot[draft_ids] if "hot" in self else draft_ids


def read_weights(path: Path) -> dict[str, mx.array]:
    """The drafter's tensors named as Eagle3Head's parameters (t2d and rotary tables dropped, d2t -> hot)."""
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, value in mx.load(str(f)).items():
            if name == "t2d" or "rotary_emb" in name or name.startswith("verifier_"):
                continue
            name = canonical(name).replace("layer.", "layers.0.", 1) if canonical(name).startswith("layer.") else name
            if name == "d2t":
                name, value = "hot", (mx.arange(value.shape[0]) + value).astype(mx.int32)
            weights[name] = value
    return weights


def load_eagle3(path: Path, model) -> Eagle3Head:
    """The drafter at `path` for the loaded target `model` (paired already: drafters.eagle3.config.check_pair), in its own
    dtype, and the target's layer tap installed (only now: a target without an EAGLE-3 drafter has none)."""
    from ...proofs.hidden_tap import install_layers

    flat = flat_config(json.loads((path / "config.json").read_text()))
    weights = read_weights(path)
    head = Eagle3Head(flat, own_embedding="embed_tokens.weight" in weights)
    if "hot" not in head:  # a d2t shipped with a draft vocabulary as wide as the target's maps nothing
        weights.pop("hot", None)
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    layers = getattr(model, "language_model", model).model.layers
    head.tap = install_layers(model, tapped_layers(flat, len(layers)))
    # One step on this (loading) thread: MLX ties unevaluated arrays (RoPE tables) to the thread that made them.
    dtype = head.fc.weight.dtype
    mx.eval(head(mx.zeros((1, 1, head.hidden_size), dtype=dtype), mx.zeros((1, 1, head.fc.weight.shape[1]),
                                                                              dtype=dtype), head.make_cache()))
    return head
