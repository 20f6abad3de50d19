"""Fixture factory: small, deterministic mlx-lm-format checkpoints built locally.

Each fixture is a real checkpoint directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that the node loads with the same code
as a downloaded model. Nothing touches the network. Weights are random but
seeded, so greedy output is reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

# A small mixed corpus (prose, code, multi-byte text) so the byte-level BPE
# learns merges and leaves some characters split across tokens, which is what
# the streaming-detokenizer tests need.
CORPUS = """\
The provider node serves language models to a network of clients. A model is
loaded on demand, kept while it is busy, and evicted when memory is needed.
Tokens stream back one at a time; every job ends with exactly one terminal
event. The quick brown fox jumps over the lazy dog. Pack my box with five dozen
liquor jugs. How vexingly quick daft zebras jump!
def generate(prompt, max_tokens=16):
    for step in range(max_tokens):
        token = sample(logits(prompt))
        yield token
class Cache:
    def trim(self, n):
        self.offset -= n
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828.
Café, naïve, façade, über, smörgåsbord, jalapeño. 日本語のテキスト。 Привет мир.
Emoji: 🙂 🚀 ✨. Math: α β γ δ ∑ ∫ ≤ ≥.
Questions and answers: What is a cache? A cache keeps recent keys and values.
What is speculation? A small model drafts tokens and the large model verifies.
"""

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int, chat_template: str, eos: str, add_bos: bool,
                    corpus: list[str] | None = None, extra_specials: tuple[str, ...] = ()) -> dict[str, int]:
    """Train a byte-level BPE (on CORPUS unless given one) and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS + list(extra_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or [CORPUS] * 4, trainer=trainer)
    ids = {s: tok.token_to_id(s) for s in SPECIALS + list(extra_specials)}
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", ids["<bos>"])]
        )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>" if add_bos else None,
                "eos_token": eos,
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "chat_template": chat_template,
                "model_max_length": 1 << 20,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    return ids


def _random_weights(config: dict, seed: int) -> dict[str, mx.array]:
    """Instantiate the mlx-lm model class for `config` and return its seeded random parameters."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    # mlx-lm initialises RMSNorm scales to ones and embeddings from N(0, 1); shrink
    # the embeddings so the tiny random model's logits are not all near-ties.
    return {k: (v * 0.5 if "embed" in k else v) for k, v in weights.items()}


def _save(out: Path, config: dict, weights: dict[str, mx.array]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def gemma4_text_config(vocab: int, ids: dict[str, int], *, hidden: int = 64, window: int = 32) -> dict:
    """A Gemma 4 text config shaped like E2B: sliding + full layers, KV-shared tail, per-layer inputs."""
    return {
        "model_type": "gemma4_text",
        "hidden_size": hidden,
        "num_hidden_layers": 6,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": hidden // 4,
        "global_head_dim": hidden // 2,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "sliding_window": window,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 1024,
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": True,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
    }


def make_gemma4_tiny(out: Path, template: str = GEMMA_TEMPLATE, extra_specials: tuple[str, ...] = ()) -> None:
    ids = build_tokenizer(_mkdir(out), 512, template, "<eos>", add_bos=True, extra_specials=extra_specials)
    text = gemma4_text_config(512, ids)
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "vocab_size": 512,
        "text_config": text,
        "eos_token_id": text["eos_token_id"],
        "bos_token_id": ids["<bos>"],
        "pad_token_id": ids["<pad>"],
    }
    weights = _random_weights(config, seed=1)
    # Store under Hugging Face names (model.language_model.*), as real Gemma 4 checkpoints do;
    # mlx-lm's sanitize maps them back on load.
    hf = {k.replace("language_model.model.", "model.language_model.", 1): v for k, v in weights.items()}
    _save(out, config, hf)


# Gemma 4's tool format, as its own chat template writes it: declarations in the system turn, calls as
# <|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>, results as <|tool_response>...<tool_response|>.
# (A shortened template with the real one's markers and shapes; mlx-lm infers the gemma4 parser from them.)
GEMMA4_TOOL_SPECIALS = ("<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                        "<tool_response|>", '<|"|>')
GEMMA4_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<start_of_turn>system\n{% for t in tools %}<|tool>declaration:"
    "{{ t['function']['name'] }}{{ t['function'] | tojson }}<tool|>{% endfor %}<end_of_turn>\n{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<|tool_call>call:{{ c['function']['name'] }}{{ '{' }}"
    "{% for k, v in c['function']['arguments'].items() %}{{ k }}:{% if v is string %}<|\"|>{{ v }}<|\"|>"
    "{% else %}{{ v | tojson }}{% endif %}{% if not loop.last %},{% endif %}{% endfor %}}<tool_call|>"
    "{% endfor %}{% elif m['role'] == 'tool' %}<|tool_response>response:{{ m['content'] }}<tool_response|>"
    "{% else %}{{ m['content'] }}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def make_gemma4_tools(out: Path) -> None:
    """gemma4-tiny's architecture with Gemma 4's tool-call tokens and a template in its tool format."""
    make_gemma4_tiny(out, GEMMA4_TOOLS_TEMPLATE, GEMMA4_TOOL_SPECIALS)


def make_gemma4_tiny_assistant(out: Path, target: Path) -> None:
    """A `gemma4_assistant` drafter for gemma4-tiny with Hugging Face config fields and weight names."""
    _mkdir(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((target / name).read_bytes())
    tcfg = json.loads((target / "config.json").read_text())["text_config"]
    hidden, backbone, vocab, centroids = 32, tcfg["hidden_size"], tcfg["vocab_size"], 16
    text = {
        "model_type": "gemma4_text",
        "num_hidden_layers": 2,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": tcfg["head_dim"],
        "global_head_dim": tcfg["global_head_dim"],
        "attention_k_eq_v": False,
        "sliding_window": tcfg["sliding_window"],
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "layer_types": ["sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2,
        "final_logit_softcapping": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vocab_size": vocab,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    config = {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": backbone,
        "num_centroids": centroids,
        "centroid_intermediate_top_k": 4,
        "use_ordered_embeddings": True,
        "tie_word_embeddings": True,
        "eos_token_id": tcfg["eos_token_id"],
        "text_config": text,
    }
    rng = np.random.default_rng(7)

    def w(*shape: int, scale: float = 0.05) -> mx.array:
        return mx.array(rng.normal(0, scale, shape).astype(np.float32))

    heads, kv_dim = text["num_attention_heads"], {"sliding_attention": text["head_dim"], "full_attention": text["global_head_dim"]}
    weights = {
        "model.embed_tokens.weight": w(vocab, hidden, scale=0.5),
        "model.norm.weight": mx.ones((hidden,)),
        "pre_projection.weight": w(hidden, 2 * backbone),
        "post_projection.weight": w(backbone, hidden),
        "masked_embedding.centroids.weight": w(centroids, hidden, scale=0.5),
        "masked_embedding.token_ordering": mx.array(rng.permutation(vocab).astype(np.int64)),
    }
    for i, kind in enumerate(text["layer_types"]):
        p, d = f"model.layers.{i}.", kv_dim[kind]
        weights |= {
            p + "self_attn.q_proj.weight": w(heads * d, hidden),
            p + "self_attn.q_norm.weight": mx.ones((d,)),
            p + "self_attn.o_proj.weight": w(hidden, heads * d),
            p + "mlp.gate_proj.weight": w(text["intermediate_size"], hidden),
            p + "mlp.up_proj.weight": w(text["intermediate_size"], hidden),
            p + "mlp.down_proj.weight": w(hidden, text["intermediate_size"]),
            p + "input_layernorm.weight": mx.ones((hidden,)),
            p + "post_attention_layernorm.weight": mx.ones((hidden,)),
            p + "pre_feedforward_layernorm.weight": mx.ones((hidden,)),
            p + "post_feedforward_layernorm.weight": mx.ones((hidden,)),
            p + "layer_scalar": mx.ones((1,)),
        }
    _save(out, config, weights)


def _llama_config(ids: dict[str, int], vocab: int, hidden: int, layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<|im_end|>"]],
    }


def make_llama_pair(target_out: Path, draft_out: Path) -> None:
    """A Llama-family target and a smaller draft model sharing one tokenizer (same vocabulary)."""
    ids = build_tokenizer(_mkdir(target_out), 512, CHATML_TEMPLATE, "<eos>", add_bos=True)
    _save(target_out, cfg := _llama_config(ids, 512, 64, 4), _random_weights(cfg, seed=2))
    _mkdir(draft_out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (draft_out / name).write_bytes((target_out / name).read_bytes())
    _save(draft_out, cfg := _llama_config(ids, 512, 32, 1), _random_weights(cfg, seed=3))


def make_llama_kv_heavy(out: Path) -> None:
    """A small Llama with a heavy KV per token (4 layers x K,V x 8 heads x 32, fp32: 8 KiB a token) and a 4k
    context, so memory tests see KV dominate what MLX holds."""
    ids = build_tokenizer(_mkdir(out), 512, CHATML_TEMPLATE, "<eos>", add_bos=True)
    config = _llama_config(ids, 512, 256, 4) | {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32,
                                                 "max_position_embeddings": 4096}
    _save(out, config, _random_weights(config, seed=5))


def make_llama_100m(out: Path) -> None:
    """A ~100M-parameter Llama (768 wide, 12 layers, float32: MLX's CPU backend runs bf16 about 10x slower) for
    load benchmarks, not for the suite. Its random head is sharpened and never picks an end token, so every
    request runs to its max_tokens on any server."""
    ids = build_tokenizer(_mkdir(out), 512, CHATML_TEMPLATE, "<eos>", add_bos=True)
    config = _llama_config(ids, 512, 768, 12) | {"intermediate_size": 2816, "num_attention_heads": 12,
                                                  "num_key_value_heads": 4, "head_dim": 64,
                                                  "max_position_embeddings": 4096}
    weights = _random_weights(config, seed=6)
    head = weights["lm_head.weight"] * 5.0
    head[mx.array(config["eos_token_id"])] = 0.0
    weights["lm_head.weight"] = head
    _save(out, config, weights)


def _qwen_config(model_type: str, ids: dict[str, int], layers: int, **extra) -> dict:
    return {"architectures": [model_type.capitalize() + "ForCausalLM"], "model_type": model_type, "hidden_size": 64,
            "num_hidden_layers": layers, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 384, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 1024, "eos_token_id": ids["<|im_end|>"]} | extra


def make_qwen3_tiny(out: Path, **sizes) -> None:  # sizes: config keys over the tiny ones
    ids = build_tokenizer(_mkdir(out), 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)
    config = _qwen_config("qwen3", ids, 2, head_dim=16, tie_word_embeddings=True) | sizes
    _save(out, config, _random_weights(config, seed=4))


def make_qwen2_tiny(out: Path) -> None:
    """A Qwen2 (which mlx-lm splits by projections and by layers) with the weights' index file that pipeline
    loading reads: node groups split either way."""
    ids = build_tokenizer(_mkdir(out), 384, CHATML_TEMPLATE, "<|im_end|>", add_bos=False)
    config = _qwen_config("qwen2", ids, 4, tie_word_embeddings=False)
    _save(out, config, weights := _random_weights(config, seed=7))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": {k: "model.safetensors" for k in sorted(weights)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


FIXTURES: dict[str, Callable[[Path], None]] = {
    "gemma4-tiny": lambda d: make_gemma4_tiny(d / "gemma4-tiny"),
    "gemma4-tiny-assistant": lambda d: make_gemma4_tiny_assistant(d / "gemma4-tiny-assistant", d / "gemma4-tiny"),
    "llama-tiny": lambda d: make_llama_pair(d / "llama-tiny", d / "llama-tiny-draft"),
    "qwen3-tiny": lambda d: make_qwen3_tiny(d / "qwen3-tiny"),
    "qwen2-tiny": lambda d: make_qwen2_tiny(d / "qwen2-tiny"),
    "llama-kv-heavy": lambda d: make_llama_kv_heavy(d / "llama-kv-heavy"),
    "gemma4-tools": lambda d: make_gemma4_tools(d / "gemma4-tools"),
}


def write_all(root: Path) -> list[Path]:
    """Write every fixture under `root` (order matters: the assistant copies its target's tokenizer)."""
    root.mkdir(parents=True, exist_ok=True)
    for build in FIXTURES.values():
        build(root)
    return sorted(p for p in root.iterdir() if p.is_dir())
