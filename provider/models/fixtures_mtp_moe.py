"""Fixture factory: the MoE members of Qwen3.5's MTP head layout, tiny, in the layout the real checkpoints ship.

`qwen3_5_moe-mtp-tiny`: a Qwen3.5-MoE (hybrid Gated DeltaNet / full attention, every layer's MLP 4 experts, top 2,
and a gated shared expert) as Hugging Face publishes it: `model.language_model.*`, the target layers' experts fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), the `mtp.*` head's one tensor per expert
(`mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`, as Qwen3.5-122B-A10B's head ships them).

`qwen3_next-mtp-tiny`: a Qwen3-Next (its flat config; `in_proj_qkvz` / `in_proj_ba` mixers; one tensor per expert
in the target and in the head, as Qwen3-Next-80B-A3B ships them).

Both: conv1d [C, 1, K], zero-centred norms, files tagged "pt"; random, seeded weights, the head distilled briefly
on its target's greedy continuations (fixtures_mtp.train_head) so that its drafts are accepted on those prompts.
"""

from __future__ import annotations

from pathlib import Path

from .fixtures_mtp import chatml_tokenizer, qwen3_5_config, write_with_head

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}


def qwen3_5_moe_config(ids: dict[str, int]) -> dict:
    config = qwen3_5_config(ids)
    config["text_config"] |= {"model_type": "qwen3_5_moe_text", **MOE}
    return config | {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"}


def qwen3_next_config(ids: dict[str, int], vocab: int = 384, hidden: int = 64) -> dict:
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": hidden,
            "intermediate_size": 128, "num_hidden_layers": 4, "full_attention_interval": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4,
            "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, **MOE, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "vocab_size": vocab, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_scaling": None, "attention_bias": False,
            "tie_word_embeddings": False, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
            "eos_token_id": ids["<|im_end|>"]}


def make_qwen3_5_moe_mtp_tiny(out: Path, seed: int = 21, train: bool = True) -> None:
    from mlx_lm.models import qwen3_5_moe

    write_with_head(out, qwen3_5_moe_config(chatml_tokenizer(out)), qwen3_5_moe, seed, train, fused_experts=True)


def make_qwen3_next_mtp_tiny(out: Path, seed: int = 31, train: bool = True) -> None:
    from mlx_lm.models import qwen3_next

    write_with_head(out, qwen3_next_config(chatml_tokenizer(out)), qwen3_next, seed, train)
