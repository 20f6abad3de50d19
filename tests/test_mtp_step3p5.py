"""Speculation with the first MTP layer StepFun Step-3.5-Flash ships inside its checkpoint (issue 42), through the real
engine.

The fixture is a tiny step3p5 (full and sliding-window layers, window 8, q/k norms, head-wise gate, MoE) in the
published layout with its MTP layer as `model.layers.4.*` (sliding-window attention, dense MLP, its own
`transformer.shared_head`), distilled briefly on its target. mlx-vlm 0.7.10 has no Step-3.5 drafter: the head is
checked against vLLM's step written here in plain MLX operations, fed the hidden before the target's final norm as
vLLM and SGLang feed it. Greedy output must equal plain decoding; sampled output must be distributed as plain
sampling."""

import mlx.core as mx
import pytest

from provider.drafters.mtp.step3p5 import load_head
from tests import mtp_checks

NAME = "step3p5-mtp-tiny"
MTP = "model.layers.4."


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_mtp_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith(MTP))
    # 4 KV heads of 16 a token, keys and values (the sliding layers' groups; the full ones have 2), float32; every
    # position kept (12 pairs, past the window). Its own LM head, the target's embedding.
    head = mtp_checks.books_as_held(target, config, load_head, 2 * 4 * 16 * 4, own_parts=False, pairs=12,
                                    own_lm_head=True)

    # Three MTP layers declared and shipped, as released: served with the first, which alone is read and booked.
    def more_layers(w):
        return w | {k.replace(MTP, f"model.layers.{i}."): v * 2 for k, v in w.items() if k.startswith(MTP)
                    for i in (5, 6)}

    types = config["layer_types"] + ["sliding_attention"] * 2
    loaded = mtp_checks.first_layer_alone(target, tmp_path / "three", more_layers,
                                          {"num_nextn_predict_layers": 3, "layer_types": types,
                                           "rope_theta": config["rope_theta"] + [1e4] * 2}, load_head)
    assert mx.array_equal(loaded.eh_proj.weight, head.eh_proj.weight).item()  # layer 4's


@pytest.mark.parametrize("broken", ["eh_proj cut", "g_proj gone", "shared head's output gone"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """eh_proj cut, the head-wise gate or the shared head's output gone: refused at load and the target served plain
    (mtp_checks.refused_when_broken)."""
    drop = {"g_proj gone": MTP + "self_attn.g_proj", "shared head's output gone": MTP + "transformer.shared_head.out"}
    mtp_checks.refused_when_broken(target, tmp_path / "bad", NAME, load_head, broken, MTP + "eh_proj.weight", drop)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens (most past the window of 8) alone, then 8 together: plain decoding's tokens, and on
    the prompts the head was distilled on, most drafts accepted."""
    mtp_checks.greedy_as_plain(target, NAME, accepted=0.5)


def test_the_drafter_feeds_the_head_the_hidden_before_the_final_norm(target):
    """A row's prompt read and first round through the engine's round loop: what the head is fed of the target is
    the hidden before its final norm (that norm's input: normed, the target's final-norm hidden), as vLLM and
    SGLang feed it: the prompt's pairs, then the last prompt token's and the first token's, each from its own
    forward. Fails when the drafter feeds the final norm's output (seen)."""
    from provider.engine.proposers import HeadDrafter
    from provider.engine.spec_rounds import Speculator
    from provider.models.gemma4_target import Target
    from provider.telemetry import SpecTelemetry

    model, tap, head = mtp_checks.loaded(target, load_head)
    fed, step = [], type(head).__call__  # what each of the head's calls is fed as the hidden
    head.__class__ = type("Fed", (type(head),), {"__call__": lambda s, e, h, c: fed.append(h) or step(s, e, h, c)})
    prompt = mtp_checks.prompts(target)[-2]
    spec = Speculator(model, HeadDrafter(head, Target(model)))
    row = spec.new_row(prompt, stats=SpecTelemetry("greedy", k=3))
    while not spec.read(row, 2048):
        pass
    first = spec.begin([row])[0]
    spec.round([row])
    model(mx.array([prompt + [first]]))
    before, after = head.tap.last, tap.last
    assert mx.allclose(model.model.norm(before), after, atol=1e-5).item()
    n = len(prompt)
    for got, want in ((fed[0], before[:, :n - 2]), (fed[1], before[:, n - 2:n])):
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def _reference(w: dict, config: dict, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """vLLM's Step-3.5 MTP step (Step3p5AMultiTokenPredictorLayer, its block built as layer num_hidden_layers) over
    pairs at positions 0..L-1, from the published tensors `w` (prefix off), in plain MLX operations; every norm
    GemmaRMSNorm (weight + 1): eh_proj(concat[enorm(e), hnorm(h)]); attention with that layer's sliding sizes
    (attention_other_setting's heads and groups), per-head q/k norms, rotate-half RoPE with that layer's theta and
    partial factor, causal within the window (i - j < window), each head's output gated by sigmoid(g_proj); a
    SwiGLU MLP clamped at that layer's swiglu_limits_shared; returned before shared_head.norm."""
    i, eps, d = config["num_hidden_layers"], config["rms_norm_eps"], config["head_dim"]
    heads, kv = (config["attention_other_setting"][k] for k in ("num_attention_heads", "num_attention_groups"))
    window, limit = config["sliding_window"], config["swiglu_limits_shared"][i]

    def norm(x, name):
        return mtp_checks.rms_norm(eps)(x, w[name + ".weight"] + 1)

    def linear(x, name):
        return x @ w[name + ".weight"].T

    def rope(x):  # [B, n, L, d]
        return mtp_checks.rotate_half(x, config["rope_theta"][i], int(d * config["partial_rotary_factors"][i]))

    B, L, _ = embeddings.shape
    x = linear(mx.concatenate([norm(embeddings, "enorm"), norm(hidden, "hnorm")], axis=-1), "eh_proj")
    h = norm(x, "input_layernorm")
    q, k, v = (linear(h, f"self_attn.{p}_proj").reshape(B, L, n, d) for p, n in (("q", heads), ("k", kv), ("v", kv)))
    q, k = norm(q, "self_attn.q_norm"), norm(k, "self_attn.k_norm")
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    q, k = rope(q), rope(k)
    k, v = mx.repeat(k, heads // kv, axis=1), mx.repeat(v, heads // kv, axis=1)
    a, b = mx.arange(L)[:, None], mx.arange(L)[None]
    scores = mx.where((b <= a) & (a - b < window), q @ k.transpose(0, 1, 3, 2) * d ** -0.5, -mx.inf)
    attn = (mx.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3)  # [B, L, heads, d]
    attn = attn * mx.sigmoid(linear(h, "self_attn.g_proj"))[..., None]
    x = x + linear(attn.reshape(B, L, heads * d), "self_attn.o_proj")
    h = norm(x, "post_attention_layernorm")
    gate = linear(h, "mlp.gate_proj")
    gate = mx.minimum(gate * mx.sigmoid(gate), limit)
    return x + linear(gate * mx.clip(linear(h, "mlp.up_proj"), -limit, limit), "mlp.down_proj")


def test_the_head_computes_the_published_step(target):
    """The head as loaded here against `_reference` on a prompt's pairs (a distilled prompt then 30 held-out tokens,
    past the window), fed the hidden before the target's final norm: in one read without a cache, and read in chunks
    of 8 into its cache then stepped 3 times on its own drafts (its own LM head over shared_head.norm; the reference
    rerun each time): the same hidden states within float32 rounding, the same drafts."""
    mtp_checks.computes_the_reference(target, MTP, load_head, _reference, 30)


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    mtp_checks.draws_through_the_shared_rule(target, load_head)
