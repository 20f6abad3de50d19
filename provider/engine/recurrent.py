"""Rolling back a hybrid target's recurrent layers (Qwen3.5 / Qwen3-Next Gated DeltaNet) after a verify forward.

A recurrent layer's cache (mlx-lm's ArraysCache: conv window, state) has folded every verified position into its
state, and unlike K/V it cannot be trimmed. A round keeps each layer's state from before the verify and what the
layer's mixer read in it; a row that accepts n of its k drafts gets its state back by running the mixer again
from there over its n + 1 kept positions. Only the mixers run again (no attention, MLP or LM head), and a mixer
over the same inputs from the same state computes what the verify (and plain decoding, a step at a time) did:
the ops path steps the recurrence one position at a time whatever the width.

`install` records mixer inputs through a subclass of the mixer's class (its code and parameters unchanged), per
thread, and only while a round asks: plain batches and other threads never pay for it.
"""

from __future__ import annotations

import threading

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

_recording = threading.local()


def _mixers(model) -> list[tuple[int, object]]:
    """(index in the model's caches, mixer) of each recurrent layer (this rank's layers: `model.layers`)."""
    layers = getattr(model, "layers", None) or []
    return [(i, layer.linear_attn) for i, layer in enumerate(layers) if getattr(layer, "linear_attn", None) is not None]


def install(model) -> bool:
    """Make the model's recurrent mixers record their inputs when asked; False when it has none."""
    mixers = [m for _, m in _mixers(model)]
    for mixer in mixers:
        base = type(mixer)
        if getattr(base, "_records_inputs", False):
            continue

        def __call__(self, inputs, mask=None, cache=None, _base=base):
            seen = getattr(_recording, "inputs", None)
            if seen is not None:
                seen[id(self)] = inputs
            return _base.__call__(self, inputs, mask, cache)

        mixer.__class__ = type(f"Recorded{base.__name__}", (base,), {"__call__": __call__, "_records_inputs": True})
    return bool(mixers)


class Rewind:
    """One verify forward's recurrent layers: their states before it and their mixers' inputs in it."""

    def __init__(self, model, caches: list):
        found = _mixers(model)
        self.layers, self.mixers = [i for i, _ in found], [m for _, m in found]
        self.before = [list(caches[i].cache) for i in self.layers]  # arrays are immutable: no copy needed
        _recording.inputs = {}

    def done(self) -> None:
        """The verify forward has run: stop recording."""
        self.inputs = [_recording.inputs[id(m)] for m in self.mixers]
        _recording.inputs = None

    def row(self, caches: list, i: int, kept: int, width: int) -> None:
        """Row i's own caches (split from the round's) back to after its first `kept` of `width` positions."""
        if kept >= width:
            return
        for mixer, layer, before, inputs in zip(self.mixers, self.layers, self.before, self.inputs):
            cache = caches[layer]
            cache.cache = [None if s is None else s[i:i + 1] for s in before]
            mixer(inputs[i:i + 1, :kept], None, cache)


def begin(model, caches: list) -> Rewind | None:
    """Before a verify forward over `caches`: a Rewind when the model has recurrent layers, else None."""
    return Rewind(model, caches) if any(isinstance(c, ArraysCache) for c in caches) else None


def evaluated(caches: list) -> list:
    """What to evaluate of rewound caches."""
    return [c.cache for c in caches if isinstance(c, ArraysCache)]
