"""The target model as the speculative round loop sees it: logits for any mlx-lm model and its final-norm
hidden state (for Gemma 4 computed here, for others read from its verification tap, when it has one), and for
Gemma 4 also what its MTP assistant (provider.drafters.gemma4_assistant) reads: the committed K/V of the last
non-shared sliding and full layers. A layer served with quantized KV (provider.engine.kv_quant) gives its K and V
as mlx-lm's quantized triples (packed, scales, biases), cut along the sequence axis alike; the assistant's
attention reads them as Gemma 4's KV-shared layers do."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, RotatingKVCache


class Target:
    """The target model seen by the round loop: logits, and for Gemma 4 its final-norm hidden and K/V."""

    def __init__(self, model):
        from ..proofs.hidden_tap import installed

        self.model = model
        self.tap = installed(model)  # another family's final-norm hidden, when the model has a tap
        lm = getattr(model, "language_model", model)
        self.gemma4 = lm.__class__.__module__.endswith("gemma4_text")
        self.lm = lm
        if self.gemma4:
            from mlx_lm.models.gemma4_text import logit_softcap

            self._softcap = logit_softcap
            args = lm.args
            first_shared = args.num_hidden_layers - args.num_kv_shared_layers
            types = args.layer_types[:first_shared]
            # The drafter reads the last non-shared layer of each attention type.
            self.kv_layer = {t: max(i for i, x in enumerate(types) if x == t) for t in set(types)}
            self.window = args.sliding_window
            self.hidden_size = args.hidden_size

    def forward(self, tokens: mx.array, caches: list) -> tuple[mx.array, mx.array | None]:
        """tokens [B, L] -> (logits [B, L, V], final-norm hidden [B, L, H] or None)."""
        if not self.gemma4:
            logits = self.model(tokens, cache=caches)
            return logits, (self.tap.last if self.tap is not None else None)
        text = self.lm.model
        hidden = text(tokens, cache=caches)
        logits = text.embed_tokens.as_linear(hidden) if self.lm.tie_word_embeddings else self.lm.lm_head(hidden)
        if self.lm.final_logit_softcapping is not None:
            logits = self._softcap(self.lm.final_logit_softcapping, logits)
        return logits, hidden

    def scaled_embedding(self, tokens: mx.array) -> mx.array:
        text = self.lm.model
        return text.embed_tokens(tokens) * text.embed_scale

    def shared_kv(self, caches: list) -> tuple[dict[str, tuple[mx.array, mx.array]], dict[str, mx.array] | None]:
        """Committed K/V of the last sliding and last full layer (sliding: the last `window` rows), and for
        merged rows, per layer type, the mask of each row's real positions."""
        out, masks = {}, {}
        for kind, i in self.kv_layer.items():
            c = caches[i]
            if isinstance(c, (BatchKVCache, BatchRotatingKVCache)):  # fresh from `merged`: in temporal order
                n = min(c._idx, self.window) if isinstance(c, BatchRotatingKVCache) else c._idx
                start = c._idx - n
                out[kind] = (_positions(c.keys, start, c._idx), _positions(c.values, start, c._idx))
                masks[kind] = (mx.arange(start, c._idx)[None] >= c.left_padding[:, None])[:, None, None, :]
            elif isinstance(c, RotatingKVCache):
                k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
                length = (k[0] if isinstance(k, tuple) else k).shape[2]
                n = min(c.offset, length, self.window)
                out[kind] = (_positions(k, length - n, length), _positions(v, length - n, length))
            else:
                out[kind] = (_positions(c.keys, 0, c.offset), _positions(c.values, 0, c.offset))
        return out, masks or None


def _positions(x, start: int, end: int):
    """Positions [start, end) of a K or V: an array, or each array of a quantized triple."""
    if isinstance(x, tuple):
        return tuple(a[..., start:end, :] for a in x)
    return x[..., start:end, :]
