"""An mlx-lm target as mlx-vlm's speculative round loops (EAGLE-3's `_eagle3_rounds`, DFlash's `_dflash_rounds`)
call the targets of its own model zoo: the outputs of the captured layers beside the logits, and the rollback they
call after each verify. eagle3_vlm.py and dflash_vlm.py run those loops on it; `timed` measures them alike.
"""

from __future__ import annotations

import time
from types import SimpleNamespace


class CaptureTarget:
    """mlx-lm's model (model.embed_tokens / layers / norm, lm_head or tied) as mlx-vlm's loops call their targets.
    Counts its forwards."""

    def __init__(self, model):
        self.lm = model
        self.model = model.model  # the drafter binds the target's embedding from here
        self.args = model.args  # DSpark's bind checks the target's hidden size, vocabulary and depth against these
        self.lm_head = getattr(model, "lm_head", None) or model.model.embed_tokens.as_linear
        self.forwards = 0

    def __call__(self, inputs, cache=None, capture_layer_ids=(), **_):
        from mlx_lm.models.base import create_attention_mask

        self.forwards += 1
        inner = self.model
        h = inner.embed_tokens(inputs)
        mask = create_attention_mask(h, cache[0])
        captured = []
        for i, (layer, c) in enumerate(zip(inner.layers, cache)):
            h = layer(h, mask, cache=c)
            if i in capture_layer_ids:
                captured.append(h)
        return SimpleNamespace(logits=self.lm_head(inner.norm(h)), hidden_states=captured, gdn_states=None)

    def rollback_speculative_cache(self, caches, state, accepted, block_size):
        for c in caches:
            c.trim(int(block_size) - 1 - int(accepted))


class TapCaptureTarget(CaptureTarget):
    """A target whose decoder layers cannot be stepped one by one from outside (Gemma 4: per-layer inputs, KV-shared
    layers fed by earlier ones, sliding and full masks): its own forward runs whole, the captured layers' outputs
    read from a layer tap (hidden_tap.install_layers: a class swap that keeps each output, nothing else changed).
    Its embedding is the text model's (mlx-vlm's drafter binds it and its embed_scale from `model`)."""

    def __init__(self, model, layer_ids: list[int]):
        from provider.proofs.hidden_tap import install_layers

        lm = getattr(model, "language_model", model)
        self.lm, self.model, self.args = model, lm.model, lm.args
        self.lm_head = getattr(lm, "lm_head", None) or lm.model.embed_tokens.as_linear
        self.tap = install_layers(model, layer_ids)
        self.forwards = 0

    def __call__(self, inputs, cache=None, capture_layer_ids=(), **_):
        self.forwards += 1
        logits = self.lm(inputs, cache=cache)
        assert list(capture_layer_ids) == list(self.tap.layers)
        return SimpleNamespace(logits=logits, hidden_states=list(self.tap._local.outs), gdn_states=None)


def argmax(logits):
    import mlx.core as mx

    return mx.argmax(logits, axis=-1)


def timed(target: CaptureTarget, one, ps: list[list[int]]) -> tuple[list[list[int]], int, int, float]:
    """(outputs, tokens delivered, target forwards, wall seconds) of `one(p)` over the prompts, after a warm run."""
    one(ps[0])  # warm, as the node's first job
    target.forwards = 0
    t0 = time.perf_counter()
    outs = [one(p) for p in ps]
    return outs, sum(map(len, outs)), target.forwards, time.perf_counter() - t0
