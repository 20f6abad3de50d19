"""Fixture factory: the tiny Qwen3 target and a DFlash drafter for it, in the published layout (models.dflash).

`qwen3-dflash-tiny` is the target (fixtures' qwen3-tiny: the same config and seeded weights); its drafter is
written beside it, at `drafter_dir(target)`: a Qwen3-like config with `architectures: [DFlashDraftModel]`,
`block_size`, `num_target_layers` and `dflash_config` {mask_token_id, target_layer_ids}, and the tensors `fc`,
`hidden_norm`, `layers.i.*`, `norm` (no embedding, no LM head: the target's), tagged "pt" as Hugging Face's writer
tags them. The drafter is distilled for seconds on its target's greedy continuations of fixtures_mtp.train_prompts
(blocks anchored along them), so that drafts on those prompts are often accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import make_qwen3_tiny
from .fixtures_mtp import HF_METADATA, TRAIN_TOKENS, fit, train_prompts

LAYER_IDS = [0, 1]  # the outputs of both layers of the 2-layer target
BLOCK = 8  # the trained block: the bonus and 7 masks


def drafter_dir(target: Path) -> Path:
    return target.with_name(target.name + "-dflash")


def drafter_config(target_config: dict, layer_ids=None, layers: int = 2) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")
    ids = list(layer_ids or LAYER_IDS)
    # The mask token: an id the training text does not use (the published Qwen3 ones: an added special token).
    mask = target_config["vocab_size"] - 2
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": layers,
            "tie_word_embeddings": True, "block_size": BLOCK, "num_target_layers": target_config["num_hidden_layers"],
            "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids}} | {k: target_config[k] for k in keys}


def make_qwen3_dflash_tiny(out: Path, seed: int = 23, train: bool = True) -> None:
    """The target at `out`, its drafter at `drafter_dir(out)` (written first: `out/config.json` marks it built)."""
    tmp = out.with_name(out.name + "-target")
    make_qwen3_tiny(tmp)
    write_drafter(tmp, drafter_dir(out), json.loads((tmp / "config.json").read_text()), seed, train)
    tmp.rename(out)


def write_drafter(target: Path, out: Path, target_config: dict, seed: int, train: bool, steps: int = 60) -> float:
    from mlx_lm.models import qwen3

    from .dflash import flat_config
    from .dflash_head import DFlashHead

    model = qwen3.Model(qwen3.ModelArgs.from_dict(target_config))
    model.load_weights(str(target / "model.safetensors"))
    config = drafter_config(target_config)
    mx.random.seed(seed)
    head = DFlashHead(flat_config(config))
    accuracy = distil(model, head, _continuations(model), steps) if train else 0.0
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(head.parameters())), metadata=HF_METADATA)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return accuracy


def build_beside(out: Path, make_target, drafter_config_of, head_class, seed: int, train: bool = True,
                 steps: int = 80, *, logits_fn=None, layer_ids=None, stride: int = 3, init=None,
                 saved=lambda weights: weights) -> None:
    """A target and a block drafter distilled for it: the target `make_target(dir)` at `out`, and beside it at
    `drafter_dir(out)` a `head_class` drafter of config `drafter_config_of(the target's text config)`, seeded,
    `init(head, model)` if given, distilled (`distil`'s arguments) unless `train` is false, its tensors written as
    `saved(name -> array)` names them. The drafter is written first: `out/config.json` marks the pair built."""
    from mlx_lm import load

    from ..memory.estimate import text_config
    from .dflash import flat_config

    tmp = out.with_name(out.name + "-target")
    make_target(tmp)
    model, _ = load(str(tmp))
    config = drafter_config_of(text_config(json.loads((tmp / "config.json").read_text())))
    mx.random.seed(seed)
    head = head_class(flat_config(config))
    if init:
        init(head, model)
    if train:
        distil(model, head, _continuations(model), steps, logits_fn, layer_ids=layer_ids, stride=stride)
    drafter = drafter_dir(out)
    drafter.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(drafter / "model.safetensors"), saved(dict(tree_flatten(head.parameters()))),
                        metadata=HF_METADATA)
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)


def _continuations(model) -> mx.array:
    from mlx_lm.generate import generate_step

    return mx.array([p + [t for (t, _), _ in zip(generate_step(mx.array(p), model), range(TRAIN_TOKENS))]
                     for p in train_prompts()])


class _Context:
    """A KV cache without a buffer (gradients flow through it): the context K/V of one training block."""

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        self.keys, self.values, self.offset = k, v, k.shape[2]
        return k, v


def block_logits(head, embed, lm_head, features: mx.array, seqs: mx.array, anchor: int, k: int) -> mx.array:
    """The drafter's logits [N, k, V] for the block anchored at `anchor` (the bonus seqs[:, anchor], the context the
    features of positions before it): what it drafts for seqs[:, anchor + 1 : anchor + 1 + k]."""
    cache = [_Context() for _ in head.layers]
    head.context(features[:, :anchor], cache, 0)
    block = mx.concatenate([seqs[:, anchor:anchor + 1], mx.full((seqs.shape[0], k), head.mask_token_id,
                                                                   dtype=seqs.dtype)], axis=1)
    return head.logits(head.block(embed(block), cache, anchor)[:, 1:], lm_head)


def distil(model, head, seqs: mx.array, steps: int, logits_fn=None, layer_ids=None, stride: int = 3) -> float:
    """Blocks anchored along the target's own continuations learn them (`logits_fn`: a block's logits as
    `block_logits` gives them, a DSpark drafter's for fixtures_dspark; `layer_ids` the tapped layers, LAYER_IDS by
    default; `stride` between anchors). Returns the training accuracy."""
    from mlx import nn

    from ..verification.hidden_tap import install_layers

    tap = install_layers(model, layer_ids or LAYER_IDS)
    model(seqs)
    features = mx.stop_gradient(tap.last)
    embed, lm_head = head.embedding(model)  # as the node's rounds read them (Gemma 4's embedding scaled)
    k, block_logits_of = BLOCK - 1, logits_fn or block_logits
    anchors = list(range(3, seqs.shape[1] - k, stride))  # 6 blocks a sequence by default: seconds, not minutes

    def loss_fn(h):
        losses = [nn.losses.cross_entropy(block_logits_of(h, embed, lm_head, features, seqs, a, k),
                                          seqs[:, a + 1:a + 1 + k]).mean() for a in anchors]
        return sum(losses) / len(losses)

    fit(head, loss_fn, steps)
    hits = [(block_logits_of(head, embed, lm_head, features, seqs, a, k).argmax(-1) == seqs[:, a + 1:a + 1 + k])
            .mean() for a in anchors]
    return mx.mean(mx.stack(hits)).item()
