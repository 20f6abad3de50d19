"""Speculation with the nextn (MTP) layers GLM-4.5 / 4.6 / 4.7 (`glm4_moe`) and DeepSeek-V3.2 (`deepseek_v32`) ship
inside their checkpoints (issue 42), through the real engine.

Each fixture is a tiny target in the published layout with its nextn layer as `model.layers.<num_hidden_layers>.*`
shipping its own embed_tokens and shared_head.head, distilled briefly on its target: glm4_moe's layer is grouped-query
attention (partial RoPE, q/k norms, biased q/k/v) + MoE; deepseek_v32's is MLA with DSA's indexer (index_topk 8) +
MoE. Greedy output must equal plain decoding; sampled output must be distributed as plain sampling."""

import json

import mlx.core as mx
import pytest

from provider.jobs import SamplingParams
from provider.models.fixtures_mtp import train_prompts
from provider.models.footprint import head_kv_shape
from provider.models.glm4_moe_lite_mtp import load_head
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
    _, head = mtp_checks.booked_once(target, config, load_head)
    assert head.lm_head is not None and "embed_tokens" in head  # the layer's own
    # glm4_moe: K and V of 2 KV heads of 16 a token; deepseek_v32: the latent (32), the rotated k_pe (8), the
    # indexer's key (16) and the zeros mlx-lm stores as its values (16). float32: what the cache holds after 5 pairs.
    per_token = 2 * 2 * 16 * 4 if config["model_type"] == "glm4_moe" else (32 + 8 + 2 * 16) * 4
    assert head_kv_shape(target, config).bytes_per_token_full == per_token
    cache = head.make_cache()
    head(mx.zeros((1, 5, 64)), mx.zeros((1, 5, 64)), cache)
    caches = cache[0].caches if hasattr(cache[0], "caches") else cache
    assert sum(x[..., :5, :].nbytes for c in caches for x in (c.keys, c.values)) == 5 * per_token


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


def test_sampled_rounds_with_the_head_are_distributed_as_plain_sampling(target):
    """The distribution test (mtp_checks.sampled_as_plain): the first 6 tokens at T = 0.7 with top_p and top_k,
    k = 3, 800 samples a side, both branches hundreds of times; and its biased control told apart."""
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, top_k=32, seed=3)
    mtp_checks.sampled_as_plain(target, load_head, train_prompts()[0], params)



def _reference(w: dict, config: dict, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """GLM-4.5's nextn step (vLLM's glm4_moe_mtp.py; the state fed on is after shared_head.norm, as the node's GLM
    heads do) over pairs at positions 0..L-1 (causal), from the published tensors `w` (prefix off), in plain MLX
    operations: eh_proj(concat[enorm(e), hnorm(h)]); grouped-query attention (biased q/k/v, per-head q/k RMS norms,
    rotate-half RoPE on the first partial_rotary_factor of each head); MoE: sigmoid router, top-k by score + its
    correction bias, weights the unbiased scores normalised and scaled, SwiGLU experts plus the shared expert;
    shared_head.norm."""
    eps, heads, kv, d = (config[k] for k in ("rms_norm_eps", "num_attention_heads", "num_key_value_heads", "head_dim"))

    def rms(x, g):
        return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def linear(x, name, bias=False):
        return x @ w[name + ".weight"].T + (w[name + ".bias"] if bias else 0)

    def swiglu(x, name):
        gate = linear(x, name + ".gate_proj")
        return linear(gate * mx.sigmoid(gate) * linear(x, name + ".up_proj"), name + ".down_proj")

    def rope(x):  # [B, n, L, d]: the first r dims rotated, the rest passed
        r = int(d * config["partial_rotary_factor"])
        angles = mx.arange(x.shape[2])[:, None] * (config["rope_theta"] ** (-mx.arange(0, r, 2) / r))[None]
        cos, sin = mx.cos(angles), mx.sin(angles)
        x1, x2 = x[..., : r // 2], x[..., r // 2: r]
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]], axis=-1)

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
    config = json.loads((target / "config.json").read_text())
    w = {k[len(NEXTN):]: v for k, v in mx.load(str(target / "model.safetensors")).items() if k.startswith(NEXTN)}
    model, tap, head = mtp_checks.loaded(target, load_head)
    ids = mx.array([train_prompts()[0] + mtp_checks.prompts(target)[-1][:40]])
    model(ids)
    hidden, embed, lm_head = tap.last, head.embed_tokens, head.lm_head
    assert mx.array_equal(embed.weight, w["embed_tokens.weight"]).item()
    tokens = mx.concatenate([ids[:, 1:], mx.array([[77]])], axis=1)
    want = _reference(w, config, embed(tokens), hidden)
    assert mx.allclose(head(embed(tokens), hidden, None), want, atol=2e-5, rtol=1e-4).item()
    cache = head.make_cache()
    for i in range(0, tokens.shape[1], 8):
        h = head(embed(tokens[:, i:i + 8]), hidden[:, i:i + 8], cache)
    assert mx.allclose(h[:, -1], want[:, -1], atol=2e-5, rtol=1e-4).item()
    h = h[:, -1:]
    for _ in range(3):
        token = lm_head(h).argmax(-1)
        tokens, hidden = mx.concatenate([tokens, token], axis=1), mx.concatenate([hidden, h], axis=1)
        want = _reference(w, config, embed(tokens), hidden)[:, -1:]
        h = head(embed(token), h, cache)
        assert mx.allclose(h, want, atol=2e-5, rtol=1e-4).item()
        assert lm_head(h).argmax(-1).item() == lm_head(want).argmax(-1).item()
