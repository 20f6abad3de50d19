"""Fixture factory for targets that carry their own MTP head: tiny checkpoints in the family's real layout.

`qwen3_5-mtp-tiny`: a Qwen3.5 (hybrid: Gated DeltaNet and full-attention layers) written as Hugging Face publishes
it (`model.language_model.*`, `lm_head.weight`, conv1d [C, 1, K], zero-centred norms) with `mtp.*` head weights
and `text_config.mtp_num_hidden_layers`, the tensors mlx-lm's sanitize drops. Random, seeded weights, the head
distilled briefly on its target (`train_head`). `write_with_head` writes any family of the layout (the MoE ones:
fixtures_mtp_moe).
"""

from __future__ import annotations

import importlib
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

    write_with_head(out, qwen3_5_config(chatml_tokenizer(out), **sizes), qwen3_5, seed, train)


def chatml_tokenizer(out: Path) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    return build_tokenizer(out, 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)


def write_with_head(out: Path, config: dict, family, seed: int, train: bool, fused_experts: bool = False) -> None:
    """A random target of mlx-lm's `family` module and its head, written in the published layout (the target's
    MoE experts fused into gate_up as Qwen3.5-MoE's, or one tensor per expert); the head distilled if `train`."""
    from .qwen3_5_mtp import Qwen35MTPHead, depth, text_args

    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(config))
    head = Qwen35MTPHead(text_args(model), depth(config))
    weights = published_target(model, fused_experts) | published_head(head)
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    if train:
        train_head(out)


def published_target(model, fused_experts: bool = False) -> dict[str, mx.array]:
    """The target's tensors as Hugging Face publishes them (what mlx-lm's sanitize converts back)."""
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
    for base in sorted({n.split(".switch_mlp.")[0] for n in weights if ".switch_mlp." in n}):
        gate, up, down = (weights.pop(f"{base}.switch_mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
        if fused_experts:  # [E, 2I, H], gate rows first (as mlx-lm's qwen3_5_moe splits it), and [E, H, I]
            weights |= {f"{base}.experts.gate_up_proj": mx.concatenate([gate, up], axis=-2),
                        f"{base}.experts.down_proj": down}
        else:
            weights |= {f"{base}.experts.{e}.{p}_proj.weight": w[e] for p, w in (("gate", gate), ("up", up),
                                                                                ("down", down))
                        for e in range(w.shape[0])}
    return weights


def experts_apart(model, random_routers: bool = False) -> dict[str, mx.array]:
    """A MoE target's tensors as ERNIE-4.5 and K-EXAONE publish them: experts one tensor per expert (not SwitchGLU's
    stack), the embedding halved (fewer near-ties), the LM head scaled by 4 (logits as peaked as a trained model's:
    sampled drafts accepted often enough); with `random_routers`, routers drawn anew in the parameters' order
    (mlx-lm initialises them to zeros: every expert tied) and the correction bias named beside the router."""
    out = {}
    for name, value in tree_flatten(model.parameters()):
        if "embed" in name:
            value = value * 0.5
        elif name == "lm_head.weight":
            value = value * 4
        elif random_routers and name.endswith("mlp.gate.weight"):
            value = 0.5 * mx.random.normal(value.shape)
        if ".switch_mlp." in name:  # [E, out, in] -> one tensor per expert
            base, proj = name.split(".switch_mlp.")
            out |= {f"{base}.experts.{e}.{proj}": value[e] for e in range(value.shape[0])}
        elif random_routers:
            out[name.replace("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias")] = value
        else:
            out[name] = value
    return out


def published_head(head) -> dict[str, mx.array]:
    """The head's tensors as the published checkpoints ship them: `mtp.*`, every norm zero-centred, and a MoE
    layer's experts one tensor per expert (`experts.{e}.{gate,up,down}_proj.weight`, not SwitchGLU's stack)."""
    out = {}
    for name, value in tree_flatten(head.parameters()):
        if value.ndim == 1:
            value = value - 1.0  # every head norm is zero-centred in the published layout
        if ".switch_mlp." in name:
            base, proj = name.split(".switch_mlp.")
            out |= {f"mtp.{base}.experts.{e}.{proj}": value[e] for e in range(value.shape[0])}
        else:
            out["mtp." + name] = value
    return out


TRAIN_TOKENS = 24  # greedy tokens per training sequence


def train_prompts(seed: int = 12) -> list[list[int]]:
    """The prompts the head is distilled on: on a random target, text a head generalises to is those, so tests
    that need drafts accepted use them (held-out prompts give acceptance near 0)."""
    mx.random.seed(seed)
    return mx.random.randint(0, 300, (16, 4)).tolist()


def train_head(out: Path, steps: int = 80, seed: int = 12) -> float:
    """Distil the fixture's head briefly on its target's own greedy continuations, so that its drafts are accepted
    often but not always, and write it back in the published layout. Returns the head's training accuracy."""
    from .qwen3_5_mtp import load_head

    def parts(model):
        lm = getattr(model, "language_model", model)  # Qwen3-Next's model is its text model
        return lm.model.embed_tokens, lm.lm_head

    head, accuracy = distil_head(out, load_head, parts, steps, seed)
    weights = dict(mx.load(str(out / "model.safetensors"))) | published_head(head)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    return accuracy


def write_and_distil(out: Path, config: dict, weights: dict, load_head, publish, steps: int, seed: int = 12) -> None:
    """The target's and head's tensors `weights` written with `config` in the published layout; with `steps`, the
    head `load_head` loads distilled (`distil_head`, through the target's embedding and LM head) and written back
    as `publish(head)` lays it out (the families whose head reads the target's parts: MiMo, ERNIE, K-EXAONE)."""
    _save(out, config, weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)
    if steps:
        head, _ = distil_head(out, load_head, lambda m: (m.model.embed_tokens, m.lm_head), steps, seed)
        weights = dict(mx.load(str(out / "model.safetensors"))) | publish(head)
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=HF_METADATA)


def fit(module, loss_fn, steps: int, lr: float = 3e-3) -> None:
    """`steps` Adam steps on `module`'s trainable parameters against `loss_fn(module)` (every fixture's drafter or
    head is distilled this way)."""
    import mlx.optimizers as optim
    from mlx import nn

    opt = optim.Adam(learning_rate=lr)
    step = nn.value_and_grad(module, loss_fn)
    for _ in range(steps):
        _, grads = step(module)
        opt.update(module, grads)
        mx.eval(module.parameters(), opt.state)


def distil_head(out: Path, load_head, parts, steps: int, seed: int):
    """The head of the checkpoint at `out` (`load_head(out, model)`) distilled on its target's greedy continuations
    of `train_prompts(seed)`: the pair (token t+1, target hidden at t) learns token t+2 through the target's frozen
    LM head. `parts(model)` gives the family's (embed_tokens, lm_head). Returns the head and its accuracy."""
    from mlx import nn
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from ..verification.hidden_tap import install

    model, _ = load(str(out))
    tap = install(model)
    head = load_head(out, model)
    prompts = train_prompts(seed)
    seqs = [p + [t for (t, _), _ in zip(generate_step(mx.array(p), model), range(TRAIN_TOKENS))] for p in prompts]
    tokens = mx.array(seqs)
    model(tokens)
    hidden = mx.stop_gradient((head.tap or tap).last)  # what the head reads: a tap of its own if it installed one
    embed_tokens, lm_head = parts(model)
    embed = embed_tokens(tokens[:, 1:-1])

    def loss_fn(h):
        return nn.losses.cross_entropy(lm_head(h(embed, hidden[:, :-2], None)), tokens[:, 2:]).mean()

    fit(head, loss_fn, steps)
    return head, (lm_head(head(embed, hidden[:, :-2], None)).argmax(-1) == tokens[:, 2:]).mean().item()


# The targets that carry their own MTP head, by the fixture factory's name (module:function, imported when built:
# those modules import this one). Built on demand (tests: conftest's `head_fixture`; bench_mtp_families --fixture),
# not by fixtures.write_all: most heads are distilled for seconds, which no test of anything else should pay.
HEAD_FIXTURES = {
    "qwen3_5-mtp-tiny": "fixtures_mtp:make_qwen3_5_mtp_tiny",
    "qwen3_5_moe-mtp-tiny": "fixtures_mtp_moe:make_qwen3_5_moe_mtp_tiny",
    "qwen3_next-mtp-tiny": "fixtures_mtp_moe:make_qwen3_next_mtp_tiny",
    "nemotron_h-mtp-tiny": "fixtures_mtp_nemotron:make_nemotron_h_mtp_tiny",
    "glm4_moe_lite-mtp-tiny": "fixtures_mtp_glm:make_glm4_moe_lite_mtp_tiny",
    "deepseek_v3-mtp-tiny": "fixtures_mtp_glm:make_deepseek_v3_mtp_tiny",
    "glm_moe_dsa-mtp-tiny": "fixtures_mtp_glm5:make_glm_moe_dsa_mtp_tiny",
    "mimo-mtp-tiny": "fixtures_mtp_mimo:make_mimo_mtp_tiny",
    "glm4_moe-mtp-tiny": "fixtures_mtp_glm4:make_glm4_moe_mtp_tiny",
    "deepseek_v32-mtp-tiny": "fixtures_mtp_glm4:make_deepseek_v32_mtp_tiny",
    "mimo_v2_flash-mtp-tiny": "fixtures_mtp_mimo_v2:make_mimo_v2_flash_mtp_tiny",
    "step3p5-mtp-tiny": "fixtures_mtp_step3p5:make_step3p5_mtp_tiny",
    "ernie4_5_moe-mtp-tiny": "fixtures_mtp_ernie:make_ernie4_5_moe_mtp_tiny",
    "exaone_moe-mtp-tiny": "fixtures_mtp_exaone:make_exaone_moe_mtp_tiny",
    "longcat_flash-mtp-tiny": "fixtures_mtp_longcat:make_longcat_flash_mtp_tiny",
    "llama-eagle3-tiny": "fixtures_eagle3:make_llama_eagle3_tiny",  # its EAGLE-3 drafter beside it (drafter_dir)
    "qwen3-dflash-tiny": "fixtures_dflash:make_qwen3_dflash_tiny",  # its DFlash drafter beside it (drafter_dir)
    "qwen3-dspark-tiny": "fixtures_dspark:make_qwen3_dspark_tiny",  # its DSpark drafter beside it (likewise)
    "qwen3-dflash2-tiny": "fixtures_dflash2:make_qwen3_dflash2_tiny",  # its DFlash2 drafter beside it (likewise)
    "gemma4-dflash-tiny": "fixtures_gemma4_dflash:make_gemma4_dflash_tiny",  # a Gemma 4 DFlash drafter beside it
    "gemma4-dspark-tiny": "fixtures_gemma4_dspark:make_gemma4_dspark_tiny",  # a Gemma 4 DSpark drafter beside it
    "muse_glimmer-dflash-tiny": "fixtures_muse_glimmer:make_muse_glimmer_dflash_tiny",  # Meta's DFlash assistant
    "laguna-dflash-tiny": "fixtures_laguna:make_laguna_dflash_tiny",  # a Laguna DFlash drafter beside it
}


def build_head_fixture(name: str, root: Path) -> Path:
    """The fixture `name` (HEAD_FIXTURES) at `root / name`, built unless it is there."""
    out = root / name
    if not (out / "config.json").exists():
        module, function = HEAD_FIXTURES[name].split(":")
        getattr(importlib.import_module(f"{__package__}.{module}"), function)(out)
    return out
