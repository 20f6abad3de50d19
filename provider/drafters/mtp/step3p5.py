"""The MTP layers StepFun Step-3.5-Flash checkpoints ship as `model.layers.<num_hidden_layers + i>.*` (which mlx-lm's
step3p5 sanitize drops), the first loaded here as a drafter from the target's own files.

One head step, as vLLM's Step3p5AMultiTokenPredictorLayer (step3p5_mtp.py) and SGLang's Step3p5MTP run it:

    x = eh_proj(concat[enorm(embed(token)), hnorm(h)])     # embed: the target's (the layer ships none)
    x = mtp_block(x)     # a Step3p5DecoderLayer built as layer num_hidden_layers: its layer_types entry (sliding
                         # in the release: window, the sliding head counts), RoPE theta and partial factor, dense MLP
    logits = shared_head.output(shared_head.norm(x))     # the layer's own LM head (`transformer.shared_head.*`)

where the pair (token t+1, h_t) sits at position t, and h_t is the hidden BEFORE a final norm: the target's before
`model.norm` (vLLM's Step3p5Model returns it so and norms it in compute_logits; SGLang passes
`hidden_states_before_norm`), and for draft steps after the first the head's own x before `shared_head.norm` (both
chain that). So the head reads the target's final norm's input, through a tap of its own on that norm
(`head.tap`, which engine.proposers.HeadDrafter reads instead of the final-norm tap). Every published norm is zero-centred
(GemmaRMSNorm): + 1 at load, where mlx-lm's own sanitize would add it (a checkpoint in the published layout).

The release declares three MTP layers (MTP-3); the node loads the first and chains it k times, as it does every
one-layer head; only that layer is read and booked. Its cache is a plain KVCache masked to the window when the layer
is a sliding one (a rotating cache could not be trimmed back after a rejection once it wraps), so it keeps every
position and is booked so. mlx-vlm 0.7.10 has no Step-3.5 drafter.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask

from .heads import finish_load, read_prefixed, target_dtype
from .nextn import NextNHead

FAMILIES = {"step3p5"}
DEPTH_KEY = "num_nextn_predict_layers"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_NEXTN = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.")
_OWN = ("enorm", "hnorm", "eh_proj", "shared_head")


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.output = nn.Linear(hidden, vocab, bias=False)


class Step3p5MTPHead(NextNHead):
    FINAL = None  # its hidden is the layer's output, before shared_head.norm (`readout`), as both runtimes chain it

    def __init__(self, args):
        from mlx_lm.models.step3p5 import Step3p5DecoderLayer

        # the layer built as layer num_hidden_layers: its settings are vLLM's layer index's, SGLang's
        super().__init__(args.hidden_size, args.rms_norm_eps, lambda: Step3p5DecoderLayer(args, args.num_hidden_layers))
        self.shared_head = SharedHead(args.hidden_size, args.vocab_size, args.rms_norm_eps)
        self.window = args.sliding_window if self.block.is_sliding else None

    @property
    def lm_head(self):
        return self.shared_head.output

    def mask(self, x: mx.array, cache):
        return create_attention_mask(x, cache, window_size=self.window)

    def readout(self, hidden: mx.array) -> mx.array:
        return self.shared_head.norm(hidden)


def install_input_tap(model):
    """A proofs.hidden_tap.HiddenTap on the text model's final norm that records its input (the hidden
    before it), installed once (over the final-norm tap if there is one, which keeps working)."""
    from ...proofs.hidden_tap import HiddenTap, _final_norm, _text_model

    norm = _final_norm(_text_model(model))
    existing = getattr(type(norm), "input_tap", None)
    if existing is not None:
        return existing
    tap, base = HiddenTap(), type(norm)

    def __call__(self, x, *args, **kwargs):
        tap.record(x)
        return base.__call__(self, x, *args, **kwargs)

    norm.__class__ = type(f"InputTapped{base.__name__}", (base,), {"__call__": __call__, "input_tap": tap})
    return tap


def serves(config: dict) -> bool:
    return config.get("model_type") in FAMILIES and depth(config) == 1


def depth(config: dict) -> int:
    """The head's decoder layers the node loads: the first MTP layer, if any is declared."""
    return min(int(config.get(DEPTH_KEY) or 0), 1)


def _sliding(config: dict) -> bool:
    """Whether mlx-lm's (and vLLM's) layer num_hidden_layers is a sliding-window one: its layer_types entry, or
    without layer_types an even index."""
    i, types = int(config["num_hidden_layers"]), config.get("layer_types")
    return types[i] == "sliding_attention" if types else i % 2 == 0


def kv_elements(config: dict) -> int:
    """K and V a token of the layer's attention (a sliding layer's KV heads from attention_other_setting); the cache
    keeps every position (masked to the window), so a token is booked whole."""
    other = config.get("attention_other_setting")
    heads = other["num_attention_groups"] if _sliding(config) and other else config["num_attention_groups"]
    return 2 * int(heads) * int(config["head_dim"])


def head_tensors(names) -> list[str]:
    """The first MTP layer's tensors: every tensor of the lowest-numbered layer that has the projection `eh_proj`
    (config-free, as footprint calls it; in the release that layer is num_hidden_layers)."""
    names = list(names)
    nextn = [int(m.group(1)) for n in names if (m := _NEXTN.match(n))]
    return [n for n in names if nextn and (m := _LAYER.match(n)) and int(m.group(1)) == min(nextn)]


def _to_head(weights: dict[str, mx.array], path: Path, args) -> dict[str, mx.array]:
    """The layer's published tensors -> the head's names, every norm + 1 where mlx-lm's step3p5 sanitize adds it:
    the layer goes through that sanitize as layer 0, among the checkpoint's other tensor names (placeholders), which
    decide whether the checkpoint is in the published layout as they do for the target."""
    from mlx_lm.models.step3p5 import Model

    from ...memory.checkpoint import open_checkpoint

    weights = {k.replace("transformer.", "", 1): v for k, v in weights.items()}  # shared_head's published place
    others = {n: mx.zeros((1,)) for n in open_checkpoint(path).tensors if not n.startswith("model.layers.0.")}
    ctx = SimpleNamespace(args=args)  # the sanitize reads only self.args
    out = {}
    for name, value in Model.sanitize(ctx, others | {"model.layers.0." + k: v for k, v in weights.items()}).items():
        if name.startswith("model.layers.0."):
            name = name[len("model.layers.0."):]
            out[name if name.startswith(_OWN) else "block." + name] = value
    return out


def load_head(path: Path, model, dtype: mx.Dtype | None = None) -> Step3p5MTPHead:
    """The head from the target's own checkpoint (only its first MTP layer is read), in the target's dtype, with a
    tap on the target's final norm's input."""
    args = model.args
    weights = _to_head(read_prefixed(path, f"model.layers.{args.num_hidden_layers}."), path, args)
    head = finish_load(Step3p5MTPHead(args), weights, dtype or target_dtype(model), args.hidden_size)
    head.tap = install_input_tap(model)
    return head
