"""Fixture factory: a tiny Llama target and an EAGLE-3 drafter for it, in the published layout (models.eagle3).

`llama-eagle3-tiny` is the target (fixtures' llama-tiny target: the same config and seeded weights); its drafter is
written beside it, at `drafter_dir(target)`: a flat Llama config with `architectures: [LlamaForCausalLMEagle3]`,
`draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`, and the tensors `fc`, `midlayer.*`, `norm`,
`lm_head` (the draft vocabulary), `d2t` (int64) and `t2d` (bool), no embedding (the target's is used), tagged "pt"
as Hugging Face's writer tags them. The drafter is distilled for seconds on its target's greedy continuations of
fixtures_mtp.train_prompts, so that drafts on those prompts are often accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import (
    CHATML_TEMPLATE,
    _llama_config,
    _random_weights,
    _save,
    build_tokenizer,
)
from .fixtures_mtp import HF_METADATA, TRAIN_TOKENS, fit, train_prompts

DRAFT_VOCAB = 256
LAYER_IDS = [1, 2, 3]  # the inputs of target layers 1..3: the outputs of layers 0..2 of its 4


def drafter_dir(target: Path) -> Path:
    return target.with_name(target.name + "-eagle3")


def drafter_config(target_config: dict, draft_vocab: int = DRAFT_VOCAB, layer_ids=None) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "tie_word_embeddings": False, "draft_vocab_size": draft_vocab,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids or LAYER_IDS)}} | \
        {k: target_config[k] for k in keys}


def make_llama_eagle3_tiny(out: Path, seed: int = 21, train: bool = True) -> None:
    """The target at `out`, its drafter at `drafter_dir(out)` (written first: `out/config.json` marks it built)."""
    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out, 512, CHATML_TEMPLATE, "<eos>", add_bos=True)
    target_config = _llama_config(ids, 512, 64, 4)
    mx.save_safetensors(str(out / "model.safetensors"), _random_weights(target_config, seed=2),
                        metadata={"format": "mlx"})
    write_drafter(out, drafter_dir(out), target_config, seed, train)
    _save(out, target_config, dict(mx.load(str(out / "model.safetensors"))))


def write_drafter(target: Path, out: Path, target_config: dict, seed: int, train: bool, steps: int = 150) -> None:
    from mlx_lm.models import llama

    from .eagle3 import flat_config
    from .eagle3_head import Eagle3Head

    model = llama.Model(llama.ModelArgs.from_dict(target_config))
    model.load_weights(str(target / "model.safetensors"))
    config = drafter_config(target_config)
    seqs = _continuations(model)
    hot = _draft_vocab(seqs, config["draft_vocab_size"])
    mx.random.seed(seed)
    head = Eagle3Head(flat_config(config), own_embedding=False)
    head.hot = mx.array(hot, dtype=mx.int32)
    if train:
        distil(model, head, seqs, steps)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), published(head, config["vocab_size"]), metadata=HF_METADATA)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _continuations(model) -> mx.array:
    from mlx_lm.generate import generate_step

    prompts = train_prompts()
    return mx.array([p + [t for (t, _), _ in zip(generate_step(mx.array(p), model), range(TRAIN_TOKENS))]
                     for p in prompts])


def _draft_vocab(seqs: mx.array, size: int) -> list[int]:
    """The ids the training text uses, then the lowest others, ascending (as published d2t tables are built:
    the most frequent target ids, in target order)."""
    seen = sorted(set(seqs.reshape(-1).tolist()))[:size]
    rest = [i for i in range(size * 2) if i not in set(seen)]
    return sorted(seen + rest[:size - len(seen)])


def distil(model, head, seqs: mx.array, steps: int) -> float:
    """The pair (token t+1, the target's tapped layers at t) learns token t+2 over the draft vocabulary (targets
    outside it do not count). Returns the training accuracy over the target ids."""
    from mlx import nn

    from ..verification.hidden_tap import install_layers

    tap = install_layers(model, [i - 1 for i in LAYER_IDS])
    model(seqs)
    hidden = mx.stop_gradient(tap.last)[:, :-2]
    embed = mx.stop_gradient(model.model.embed_tokens(seqs[:, 1:-1]))
    to_draft = mx.full((model.args.vocab_size,), -1, dtype=mx.int32)
    to_draft[head.hot] = mx.arange(head.hot.shape[0], dtype=mx.int32)
    labels = to_draft[seqs[:, 2:]]
    keep = labels >= 0

    def loss_fn(h):
        ce = nn.losses.cross_entropy(h.draft_logits(h(embed, hidden, None)), mx.maximum(labels, 0))
        return (ce * keep).sum() / keep.sum()

    head.freeze(recurse=False, keys=["hot"])  # the draft vocabulary is given, not learned
    fit(head, loss_fn, steps)
    drafted = head.to_target(head.draft_logits(head(embed, hidden, None)).argmax(-1))
    return (drafted == seqs[:, 2:]).mean().item()


def published(head, vocab: int) -> dict[str, mx.array]:
    """The drafter's tensors as published EAGLE-3 checkpoints name them."""
    out = {}
    for name, value in tree_flatten(head.parameters()):
        if name == "hot":
            out["d2t"] = (value - mx.arange(value.shape[0])).astype(mx.int64)
            t2d = mx.zeros((vocab,), dtype=mx.bool_)
            t2d[value] = True
            out["t2d"] = t2d
        else:
            out[name.replace("layers.0.", "midlayer.")] = value
    return out
