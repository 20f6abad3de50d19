"""Fixture factory for targets that carry their own MTP head: tiny checkpoints in the family's real layout.

`qwen3_5-mtp-tiny`: a Qwen3.5 (hybrid: Gated DeltaNet and full-attention layers) written as Hugging Face publishes
it (`model.language_model.*`, `lm_head.weight`, conv1d [C, 1, K], zero-centred norms) with `mtp.*` head weights
and `text_config.mtp_num_hidden_layers`, the tensors mlx-lm's sanitize drops. Random, seeded weights: the head
is untrained, so it rarely agrees with its target, which leaves every acceptance path to the tests.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .fixtures import CHATML_TEMPLATE, _save, build_tokenizer

# Hugging Face's writer tags its files "pt". mlx-vlm reads a file tagged "mlx" as already converted (its head norms
# taken as stored, not + 1), so the published tag is part of the layout: with "mlx" the two loaders disagree.
HF_METADATA = {"format": "pt"}

_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
            ".k_norm.weight")


def qwen3_5_config(ids: dict[str, int], vocab: int = 384, hidden: int = 64, **sizes) -> dict:
    text = {"model_type": "qwen3_5_text", "hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": 4,
            "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": vocab, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1]},
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "eos_token_id": ids["<|im_end|>"]}
    text |= sizes
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": False, "eos_token_id": ids["<|im_end|>"]}


def make_qwen3_5_mtp_tiny(out: Path, seed: int = 11, train: bool = True, **sizes) -> None:
    """The fixture; `sizes` override its text config (tools/bench/memory_ledger.py builds a heavier one)."""
    from mlx_lm.models import qwen3_5

    from .qwen3_5_mtp import Qwen35MTPHead

    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)
    config = qwen3_5_config(ids, **sizes)
    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    head = Qwen35MTPHead(model.language_model.args, 1)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if "embed" in name:
            value = value * 0.5  # as fixtures._random_weights: fewer near-ties in a tiny random model's logits
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)  # mlx-lm's [C, K, 1] -> Hugging Face's [C, 1, K]
        elif name.endswith(_CENTRED):
            value = value - 1.0
        name = name.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head",
                                                                                      "lm_head")
        weights[name] = value
    for name, value in tree_flatten(head.parameters()):
        if value.ndim == 1:
            value = value - 1.0  # every head norm is zero-centred in the published layout
        weights["mtp." + name] = value
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    if train:
        train_head(out)


TRAIN_TOKENS = 24  # greedy tokens per training sequence


def train_prompts(seed: int = 12) -> list[list[int]]:
    """The prompts the head is distilled on: on a random target, text a head generalises to is those, so tests
    that need drafts accepted use them (held-out prompts give acceptance near 0)."""
    mx.random.seed(seed)
    return mx.random.randint(0, 300, (16, 4)).tolist()


def train_head(out: Path, steps: int = 80, seed: int = 12) -> float:
    """Distil the fixture's head briefly on its target's own greedy continuations (the pair (token t+1, target
    hidden at t) learns token t+2, through the target's frozen LM head), so that its drafts are accepted often
    but not always, and write it back in the published layout. Returns the head's training accuracy."""
    import mlx.optimizers as optim
    from mlx import nn
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from ..verification.hidden_tap import install
    from .qwen3_5_mtp import load_head

    model, _ = load(str(out))
    tap = install(model)
    head = load_head(out, model)
    prompts = train_prompts(seed)
    seqs = [p + [t for (t, _), _ in zip(generate_step(mx.array(p), model), range(TRAIN_TOKENS))] for p in prompts]
    tokens = mx.array(seqs)
    model(tokens)
    hidden = mx.stop_gradient(tap.last)
    lm = model.language_model
    embed = lm.model.embed_tokens(tokens[:, 1:-1])

    def loss_fn(h):
        logits = lm.lm_head(h(embed, hidden[:, :-2], None))
        return nn.losses.cross_entropy(logits, tokens[:, 2:]).mean()

    opt = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(head, loss_fn)
    for _ in range(steps):
        _, grads = step(head)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state)
    accuracy = (lm.lm_head(head(embed, hidden[:, :-2], None)).argmax(-1) == tokens[:, 2:]).mean().item()
    weights = dict(mx.load(str(out / "model.safetensors")))
    for name, value in tree_flatten(head.parameters()):
        weights["mtp." + name] = value - 1.0 if value.ndim == 1 else value
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    return accuracy
