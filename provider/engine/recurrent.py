"""Rolling back a hybrid target's recurrent layers after a verify forward: Qwen3.5 / Qwen3-Next's Gated DeltaNet
(`layer.linear_attn`) and Nemotron-H's Mamba2 (`layer.mixer` of an "M" block).

A recurrent layer's cache (mlx-lm's ArraysCache: conv window, state) has folded every verified position into its
state, and unlike K/V it cannot be trimmed. A round keeps each layer's state from before the verify and what the
layer's mixer read in it; a row that accepts n of its k drafts gets its state back by running the mixer again
from there over its n + 1 kept positions. Only the mixers run again (no attention, MLP or LM head).

Exactness. Gated DeltaNet's ops path steps its recurrence one position at a time whatever the width, so a re-run
computes what the verify (and plain decoding, a step at a time) did. Mamba2's does not: mlx-lm's `ssm_attn` scans
a width-L chunk in closed form (decays from cumulative sums, a masked matmul), which lands ~1 float32 ulp away from
L single steps (measured on the fixture: 1.5e-8 on a state of magnitude 0.2). So while a round verifies or
rewinds, a Mamba2 mixer steps its SSM one position at a time through mlx-lm's own `_ssm` (its projections and
conv still at full width): each step is the call plain decoding makes (on Metal, the same single-step kernel),
so its state is the one plain decoding reaches from the same inputs, and the rewound state is the verify's own:
bit for bit where the projections round alike at every width (MLX's reference CPU BLAS), else within their
rounding (tests/test_mtp_nemotron.py, tests/test_mtp_qwen_moe.py).

`install` records mixer inputs through a subclass of the mixer's class (its code and parameters unchanged), per
thread, and only while a round asks: plain batches, prefills and other threads never pay for it.
"""

from __future__ import annotations

import threading

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

_recording = threading.local()


def _mixers(model) -> list[tuple[int, object]]:
    """(index in the model's caches, mixer) of each recurrent layer (this rank's layers: `model.layers`). Qwen3.5
    and Qwen3-Next have a cache per layer; Nemotron-H only its Mamba2 ("M") and attention ("*") blocks."""
    found, slot = [], 0
    for layer in getattr(model, "layers", None) or []:
        kind = getattr(layer, "block_type", None)
        if kind is None:
            if getattr(layer, "linear_attn", None) is not None:
                found.append((slot, layer.linear_attn))
            slot += 1
        elif kind in ("M", "*"):
            if kind == "M":
                found.append((slot, layer.mixer))
            slot += 1
    return found


def _stepping() -> bool:
    return getattr(_recording, "inputs", None) is not None or getattr(_recording, "replay", False)


def _stepwise_ssm(self, hidden_states, B, C, dt, cache, mask, _base=None):
    """mlx-lm's Mamba2 `_ssm`, a position at a time while a round verifies or rewinds (see the module's note)."""
    width = hidden_states.shape[1]
    if width == 1 or cache is None or not _stepping():
        return _base._ssm(self, hidden_states, B, C, dt, cache, mask)
    return mx.concatenate([_base._ssm(self, hidden_states[:, j:j + 1], B[:, j:j + 1], C[:, j:j + 1], dt[:, j:j + 1],
                                      cache, None if mask is None else mask[..., j:j + 1]) for j in range(width)],
                          axis=1)


def install(model) -> bool:
    """Make the model's recurrent mixers record their inputs when asked; False when it has none."""
    from mlx_lm.models.nemotron_h import NemotronHMamba2Mixer

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

        methods = {"__call__": __call__, "_records_inputs": True}
        if issubclass(base, NemotronHMamba2Mixer):
            methods["_ssm"] = lambda self, *a, _base=base: _stepwise_ssm(self, *a, _base=_base)
        mixer.__class__ = type(f"Recorded{base.__name__}", (base,), methods)
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
        _recording.replay = True
        try:
            for mixer, layer, before, inputs in zip(self.mixers, self.layers, self.before, self.inputs):
                cache = caches[layer]
                cache.cache = [None if s is None else s[i:i + 1] for s in before]
                mixer(inputs[i:i + 1, :kept], None, cache)
        finally:
            _recording.replay = False


def begin(model, caches: list) -> Rewind | None:
    """Before a verify forward over `caches`: a Rewind when the model has recurrent layers, else None."""
    return Rewind(model, caches) if any(isinstance(c, ArraysCache) for c in caches) else None


def evaluated(caches: list) -> list:
    """What to evaluate of rewound caches."""
    return [c.cache for c in caches if isinstance(c, ArraysCache)]
