"""Speculation with the nextn (MTP) layers GLM-4.5 / 4.6 / 4.7 (`glm4_moe`) and DeepSeek-V3.2 (`deepseek_v32`) ship
inside their checkpoints (issue 42), through the real engine.

Each fixture is a tiny target in the published layout with its nextn layer as `model.layers.<num_hidden_layers>.*`
shipping its own embed_tokens and shared_head.head, distilled briefly on its target: glm4_moe's layer is grouped-query
attention (partial RoPE, q/k norms, biased q/k/v) + MoE; deepseek_v32's is MLA with DSA's indexer (index_topk 8) +
MoE. Greedy output must equal plain decoding; sampled output must be distributed as plain sampling."""

import mlx.core as mx
import pytest

from provider.jobs import SamplingParams
from tools.fixtures.mtp import train_prompts
from provider.drafters.mtp.glm4_moe_lite import load_head
from tests import mtp_checks

NEXTN = "model.layers.3."  # num_hidden_layers = 3


@pytest.fixture(scope="module", params=["glm4_moe-mtp-tiny", "deepseek_v32-mtp-tiny"])
def target(request, head_fixture):
    return head_fixture(request.param)


def _name(target) -> str:
    return target.name


def test_capability_and_books_from_config_and_the_nextn_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith(NEXTN))
    assert config["num_nextn_predict_layers"] == 1
    # Booked once, as the drafter: the nextn layer's tensors (its own embedding and LM head too) + activations.
    # glm4_moe: K and V of 2 KV heads of 16 a token; deepseek_v32: the latent (32), the rotated k_pe (8), the
    # indexer's key (16) and the zeros mlx-lm stores as its values (16). float32: what the cache holds after 5 pairs.
    # The layer's own embedding and LM head.
    per_token = 2 * 2 * 16 * 4 if config["model_type"] == "glm4_moe" else (32 + 8 + 2 * 16) * 4
    mtp_checks.books_as_held(target, config, load_head, per_token, own_parts=True)


@pytest.mark.parametrize("broken", ["eh_proj cut", "attention gone", "own embedding without its head"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """The header still says a head is there (capability holds); the load refuses it cleanly, and the node decodes
    plain with the reason (auto), its output plain decoding's."""
    gone = NEXTN + "self_attn.k_proj" if "glm4" in target.name else NEXTN + "self_attn.indexer.wk"
    change = {
        "eh_proj cut": lambda w: w | {NEXTN + "eh_proj.weight": w[NEXTN + "eh_proj.weight"][:, :127]},
        "attention gone": lambda w: {k: v for k, v in w.items() if not k.startswith(gone)},
        "own embedding without its head": lambda w: {k: v for k, v in w.items()
                                                     if k != NEXTN + "shared_head.head.weight"},
    }[broken]
    bad = mtp_checks.rewritten(target, tmp_path / "bad", change)
    mtp_checks.refused_and_served_plain(bad, target, _name(target), load_head)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens alone, then 8 together: plain decoding's tokens, and on the prompts the head was
    distilled on, most drafts accepted."""
    _, alone, _ = mtp_checks.greedy_as_plain(target, _name(target))
    spec = [done.telemetry.speculation for _, _, done, _ in alone[:4]]
    assert sum(s.accepted for s in spec) > 0.4 * sum(s.judged for s in spec), spec


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, top_k=32, seed=3)
    mtp_checks.draws_through_the_shared_rule(target, load_head, train_prompts()[0], params)



def _reference(w: dict, config: dict, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """GLM-4.5's nextn step (vLLM's glm4_moe_mtp.py; the state fed on is after shared_head.norm, as the node's GLM
    heads do) over pairs at positions 0..L-1 (causal), from the published tensors `w` (prefix off), in plain MLX
    operations: eh_proj(concat[enorm(e), hnorm(h)]); grouped-query attention (biased q/k/v, per-head q/k RMS norms,
    rotate-half RoPE on the first partial_rotary_factor of each head); MoE: sigmoid router, top-k by score + its
    correction bias, weights the unbiased scores normalised and scaled, SwiGLU experts plus the shared expert;
    shared_head.norm."""
    eps, heads, kv, d = (config[k] for k in ("rms_norm_eps", "num_attention_heads", "num_key_value_heads", "head_dim"))

    rms = mtp_checks.rms_norm(eps)

    def linear(x, name, bias=False):
        return x @ w[name + ".weight"].T + (w[name + ".bias"] if bias else 0)

    def swiglu(x, name):
        gate = linear(x, name + ".gate_proj")
        return linear(gate * mx.sigmoid(gate) * linear(x, name + ".up_proj"), name + ".down_proj")

    def rope(x):  # [B, n, L, d]: the first r dims rotated, the rest passed
        return mtp_checks.rotate_half(x, config["rope_theta"], int(d * config["partial_rotary_factor"]))

    B, L, _ = embeddings.shape
    x = linear(mx.concatenate([rms(embeddings, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], axis=-1),
               "eh_proj")
    h = rms(x, w["input_layernorm.weight"])
    q, k, v = (linear(h, f"self_attn.{p}_proj", bias=True).reshape(B, L, n, d) for p, n in
               (("q", heads), ("k", kv), ("v", kv)))
    q, k = rms(q, w["self_attn.q_norm.weight"]), rms(k, w["self_attn.k_norm.weight"])
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    q, k = rope(q), rope(k)
    k, v = mx.repeat(k, heads // kv, axis=1), mx.repeat(v, heads // kv, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * d ** -0.5 + mx.triu(mx.full((L, L), -mx.inf), k=1)
    x = x + linear((mx.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, L, heads * d),
                   "self_attn.o_proj")
    h = rms(x, w["post_attention_layernorm.weight"])
    score = mx.sigmoid(linear(h, "mlp.gate"))
    top = mx.argsort(-(score + w["mlp.gate.e_score_correction_bias"]), axis=-1)[..., : config["num_experts_per_tok"]]
    weight = mx.take_along_axis(score, top, axis=-1)
    weight = weight / weight.sum(-1, keepdims=True) * config["routed_scaling_factor"]
    experts = mx.stack([swiglu(h, f"mlp.experts.{e}") for e in range(config["n_routed_experts"])], axis=-2)
    routed = (mx.take_along_axis(experts, top[..., None], axis=-2) * weight[..., None]).sum(-2)
    return rms(x + routed + swiglu(h, "mlp.shared_experts"), w["shared_head.norm.weight"])


def test_the_glm4_moe_head_computes_the_published_step(target):
    """The head as loaded here against `_reference` on a prompt's pairs (a distilled prompt then 40 held-out tokens),
    its own embedding and LM head: in one read without a cache, and read in chunks of 8 into its cache then stepped
    3 times on its own drafts (the reference rerun over the whole sequence each time): the same hidden states within
    float32 rounding and the same draft tokens."""
    if "glm4" not in target.name:
        pytest.skip("deepseek_v32's layer is GLM-5's, checked against mlx-vlm's drafter in test_mtp_glm5")
    w, head = mtp_checks.computes_the_reference(target, NEXTN, load_head, _reference, 40, own_parts=True)
    assert mx.array_equal(head.embed_tokens.weight, w["embed_tokens.weight"]).item()
