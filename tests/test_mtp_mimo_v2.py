"""Speculation with the first MTP layer Xiaomi MiMo-V2-Flash ships inside its checkpoint (issue 42), through the real
engine.

The fixture is a tiny mimo_v2_flash (full and sliding-window attention layers, window 8, sinks, MoE) in the published
layout with its MTP layer as `model.mtp.layers.0.*` (sliding-window attention with sinks, dense MLP), distilled
briefly on its target. mlx-vlm 0.7.10 has no MiMo-V2 drafter. Greedy output must equal plain decoding; sampled
output must be distributed as plain sampling."""

import mlx.core as mx
import pytest

from tools.fixtures.mtp import train_prompts
from provider.drafters.mtp.mimo_v2 import load_head
from tests import mtp_checks

NAME = "mimo_v2_flash-mtp-tiny"
MTP = "model.mtp.layers.0."


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_mtp_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith("model.mtp."))
    # 2 KV heads a token, keys of 16 and values of 8 (the sliding layers' sizes), float32; every position kept (12
    # pairs, past the window). The target's embedding and LM head.
    mtp_checks.books_as_held(target, config, load_head, 2 * (16 + 8) * 4, own_parts=False, pairs=12)


@pytest.mark.parametrize("broken", ["eh_proj cut", "sinks gone", "pre_mlp_layernorm gone"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """eh_proj cut, the attention sinks or pre_mlp_layernorm gone: refused at load and the target served plain
    (mtp_checks.refused_when_broken)."""
    drop = {"sinks gone": MTP + "self_attn.attention_sink_bias", "pre_mlp_layernorm gone": MTP + "pre_mlp_layernorm"}
    mtp_checks.refused_when_broken(target, tmp_path / "bad", NAME, load_head, broken, MTP + "eh_proj.weight", drop)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens (most past the window of 8) alone, then 8 together: plain decoding's tokens, and on
    the prompts the head was distilled on, most drafts accepted."""
    mtp_checks.greedy_as_plain(target, NAME, accepted=0.4)


def test_the_cached_head_slides_its_window(target):
    """Read in chunks of 8 into its cache, the head gives what it gives over the whole sequence at once (the
    window mask the same both ways), and that differs from a head that sees every position (the window matters)."""
    model, tap, head = mtp_checks.loaded(target, load_head)
    ids = mx.array([train_prompts()[0] + mtp_checks.prompts(target)[-1][:30]])
    model(ids)
    hidden, embed = tap.last, model.model.embed_tokens
    tokens = mx.concatenate([ids[:, 1:], mx.array([[77]])], axis=1)
    want = head(embed(tokens), hidden, None)
    cache = head.make_cache()
    got = mx.concatenate([head(embed(tokens[:, i:i + 8]), hidden[:, i:i + 8], cache)
                          for i in range(0, tokens.shape[1], 8)], axis=1)
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-4).item()
    head.window = 10_000
    assert not mx.allclose(head(embed(tokens), hidden, None)[:, -1], want[:, -1], atol=1e-3).item()


def _reference(w: dict, config: dict, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """MiMo-V2-Flash's MTP step (SGLang's MiMoV2ModelNextN) over pairs at positions 0..L-1, from the published
    tensors `w` (prefix off), in plain MLX operations: eh_proj(concat[enorm(e), hnorm(h)]); grouped-query attention
    with the sliding layers' sizes (keys swa_head_dim, values swa_v_head_dim), rotate-half RoPE with base
    swa_rope_theta on the first partial_rotary_factor of each head, causal within the window (i - j < window), a
    per-head sink logit in the softmax's denominator; a SwiGLU MLP after pre_mlp_layernorm; final_layernorm."""
    eps, heads, kv = config["layernorm_epsilon"], config["swa_num_attention_heads"], config["swa_num_key_value_heads"]
    d, dv, window = config["swa_head_dim"], config["swa_v_head_dim"], config["sliding_window_size"]

    rms = mtp_checks.rms_norm(eps)

    def linear(x, name):
        return x @ w[name + ".weight"].T

    def rope(x):  # [B, n, L, d]: the first r dims rotated, the rest passed
        return mtp_checks.rotate_half(x, config["swa_rope_theta"], int(d * config["partial_rotary_factor"]))

    B, L, _ = embeddings.shape
    x = linear(mx.concatenate([rms(embeddings, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], axis=-1),
               "eh_proj")
    h = rms(x, w["input_layernorm.weight"])
    q, k, v = (linear(h, f"self_attn.{p}_proj").reshape(B, L, n, size).transpose(0, 2, 1, 3)
               for p, n, size in (("q", heads, d), ("k", kv, d), ("v", kv, dv)))
    q, k = rope(q), rope(k)
    k, v = mx.repeat(k, heads // kv, axis=1), mx.repeat(v, heads // kv, axis=1)
    i, j = mx.arange(L)[:, None], mx.arange(L)[None]
    scores = mx.where((j <= i) & (i - j < window), q @ k.transpose(0, 1, 3, 2) * d ** -0.5, -mx.inf)
    sink = mx.broadcast_to(w["self_attn.attention_sink_bias"].reshape(1, heads, 1, 1), (B, heads, L, 1))
    probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :L]
    x = x + linear((probs @ v).transpose(0, 2, 1, 3).reshape(B, L, heads * dv), "self_attn.o_proj")
    h = rms(x, w["pre_mlp_layernorm.weight"])
    gate = linear(h, "mlp.gate_proj")
    x = x + linear(gate * mx.sigmoid(gate) * linear(h, "mlp.up_proj"), "mlp.down_proj")
    return rms(x, w["final_layernorm.weight"])


def test_the_head_computes_the_published_step(target):
    """The head as loaded here against `_reference` on a prompt's pairs (a distilled prompt then 30 held-out tokens,
    past the window): in one read without a cache, and read in chunks of 8 into its cache then stepped 3 times on
    its own drafts (the reference rerun each time): the same hidden states within float32 rounding, the same drafts."""
    mtp_checks.computes_the_reference(target, MTP, load_head, _reference, 30)


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    mtp_checks.draws_through_the_shared_rule(target, load_head)
