"""The final-norm hidden state of a model's forwards (TOPLOC's tensor: what the LM head reads), and each
token's largest entries of it.

`install` swaps the class of the text model's final norm for a subclass that keeps its last output, so every
forward (mlx-lm's batch generator, the round loop, a verifier's prefill) leaves its hidden state where the
engine reads it, and the parameter tree and the model's code stay as they are. A plain batch reads it per row
from a logits processor: mlx-lm calls a step's processors row by row right after its forward, so the n-th
call since the forward is row n (`HiddenTap.next_row`); every row of a committing batch has one.
"""

from __future__ import annotations

import threading

import mlx.core as mx

from .commitment import TOP_K


class HiddenTap:
    """Per thread: the engine thread's forwards and their processors run on it, while another thread may run
    the same model (the speculation profiler measures a pair while it serves)."""

    def __init__(self):
        self.hidden_size = 0  # known from the first forward (the load's warm-up)
        self._local = threading.local()

    @property
    def last(self) -> mx.array | None:
        """[B, L, H] of this thread's latest forward."""
        return getattr(self._local, "last", None)

    def record(self, hidden: mx.array) -> None:
        self._local.last, self._local.row, self.hidden_size = hidden, 0, hidden.shape[-1]

    def next_row(self) -> mx.array:
        """The next row's hidden state at this thread's latest forward's last position [1, H]."""
        row = self._local.row
        self._local.row = row + 1
        return self._local.last[row:row + 1, -1, :]

    def next_row_entries(self) -> tuple[mx.array, mx.array, int]:
        """The top entries at this thread's latest forward's last position, of every row ([B, K] each), and which
        row is the next one's. The first row's call takes every row's at once (one small graph a step) and
        schedules it with the forward it reads: evaluated a step later instead, it would wait behind the next
        forward (one stream, in order) and the step's Python work would no longer overlap it. Whoever reads them
        a step later picks the row out in numpy (an MLX slice would be a graph of its own, queued behind)."""
        local = self._local
        row = local.row
        local.row = row + 1
        if row == 0:
            local.entries = top_entries(local.last[:, -1, :])
            mx.async_eval(local.entries)
        return (*local.entries, row)


def _text_model(model):
    lm = getattr(model, "language_model", model)
    inner = getattr(lm, "model", None)
    return getattr(lm, "backbone", None) if inner is None else inner  # Nemotron-H's text model is its backbone


def _final_norm(inner):
    norm = getattr(inner, "norm", None)
    return getattr(inner, "norm_f", None) if norm is None else norm  # Nemotron-H's is `norm_f`


def installed(model) -> HiddenTap | None:
    """The model's tap if `install` put one on it."""
    return getattr(type(_final_norm(_text_model(model))), "hidden_tap", None)


def install(model) -> HiddenTap | None:
    """The model's tap, installed once; None when its text model has no final norm (`norm`, or Nemotron-H's
    `norm_f`): a family whose commitments this node cannot make."""
    inner = _text_model(model)
    norm = _final_norm(inner)
    if norm is None or not callable(norm):
        return None
    existing = getattr(type(norm), "hidden_tap", None)
    if existing is not None:
        return existing
    tap = HiddenTap()
    base = type(norm)

    def __call__(self, x, *args, **kwargs):
        out = base.__call__(self, x, *args, **kwargs)
        tap.record(out)
        return out

    norm.__class__ = type(f"Tapped{base.__name__}", (base,), {"__call__": __call__, "hidden_tap": tap})
    return tap


class LayerTap:
    """The outputs of chosen decoder layers of a model's latest forward on this thread, concatenated [B, L, n * H]:
    what an EAGLE-3 drafter reads (models.eagle3_head). Per thread, as HiddenTap."""

    def __init__(self, layers: tuple[int, ...]):
        self.layers = layers
        self._local = threading.local()

    def record(self, slot: int, out: mx.array) -> None:
        local = self._local
        if slot == 0:  # the lowest tapped layer: a new forward
            local.outs, local.cat, local.row = [None] * len(self.layers), None, 0
        local.outs[slot] = out

    @property
    def last(self) -> mx.array | None:
        local = self._local
        if getattr(local, "cat", None) is None and getattr(local, "outs", None) \
                and all(o is not None for o in local.outs):
            local.cat = mx.concatenate(local.outs, axis=-1)
        return getattr(local, "cat", None)

    def next_row(self) -> mx.array:
        """The next row's concatenation at this thread's latest forward's last position [1, 1, n * H]."""
        row = self._local.row
        self._local.row = row + 1
        return self.last[row:row + 1, -1:, :]


def install_layers(model, layers: list[int]) -> LayerTap:
    """A tap on the outputs of `layers` (ascending indices of the text model's decoder layers), installed by a class
    swap of each of those layers, as `install` swaps the final norm: installed only for a target whose drafter
    reads them, so no other model pays for it. Installed once: a second call returns the first tap."""
    tapped = [model_layers(model)[i] for i in layers]
    existing = getattr(type(tapped[0]), "layer_tap", None)
    if existing is not None:
        return existing
    tap = LayerTap(tuple(layers))
    for slot, layer in enumerate(tapped):
        base = type(layer)

        def __call__(self, *args, _base=base, _slot=slot, **kwargs):
            out = _base.__call__(self, *args, **kwargs)
            tap.record(_slot, out[0] if isinstance(out, tuple) else out)  # Gemma 4's: (h, shared K/V, offset)
            return out

        layer.__class__ = type(f"LayerTapped{base.__name__}", (base,), {"__call__": __call__, "layer_tap": tap})
    return tap


def model_layers(model) -> list:
    return _text_model(model).layers


def top_entries(hidden: mx.array) -> tuple[mx.array, mx.array]:
    """hidden [..., H] -> each position's TOP_K largest-magnitude entries: indices [..., K] (uint32) and
    their float16 bits [..., K] (uint16). Lazy."""
    idx = mx.argpartition(-mx.abs(hidden.astype(mx.float32)), kth=TOP_K - 1, axis=-1)[..., :TOP_K]
    vals = mx.take_along_axis(hidden, idx, axis=-1).astype(mx.float16)
    return idx.astype(mx.uint32), mx.view(vals, mx.uint16)
