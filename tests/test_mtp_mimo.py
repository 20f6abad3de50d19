"""Speculation with Xiaomi MiMo's MTP layer shipped inside its checkpoint (issue 42), through the real engine.

The fixture is a tiny mimo (Qwen2-style layers) in the published layout with its MTP layer as `model.mtp_layers.0.*`,
distilled briefly on its target. mlx-vlm has no MiMo drafter: the head is checked against a reference written here
from vLLM's published step (mimo_mtp.py) in plain MLX operations, not mlx-lm's layer. Greedy output must equal plain
decoding; sampled output must be distributed as plain sampling."""

import math

import mlx.core as mx
import pytest

from provider.drafters.mtp.mimo import load_head
from tests import mtp_checks

NAME = "mimo-mtp-tiny"
MTP = "model.mtp_layers.0."


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_mtp_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: ".mtp_layers." in k)
    # mlx-lm's mimo sanitize drops the layer (the target's books hold none of it); the head is booked once.
    # K and V, 2 KV heads of 64 / 4, float32, a token: what the head's cache holds after 5 pairs. The target's
    # embedding and LM head.
    head = mtp_checks.books_as_held(target, config, load_head, 2 * 2 * 16 * 4, own_parts=False)
    # Two MTP layers declared and shipped: served with the first, which alone is read and booked.
    def second_layer(w):
        return w | {k.replace(".mtp_layers.0.", ".mtp_layers.1."): v * 2 for k, v in w.items() if k.startswith(MTP)}

    loaded = mtp_checks.first_layer_alone(target, tmp_path / "two", second_layer, {"num_nextn_predict_layers": 2},
                                          load_head)
    assert mx.array_equal(loaded.input_proj.weight, head.input_proj.weight).item()  # layer 0's


@pytest.mark.parametrize("broken", ["input_proj cut", "q_proj bias gone"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """input_proj cut or q_proj's bias gone: refused at load and the target served plain
    (mtp_checks.refused_when_broken)."""
    drop = {"q_proj bias gone": MTP + "self_attn.q_proj.bias"}
    mtp_checks.refused_when_broken(target, tmp_path / "bad", NAME, load_head, broken, MTP + "input_proj.weight", drop)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens alone then 8 together: plain decoding's tokens, and on the prompts the head was
    distilled on, most drafts accepted."""
    mtp_checks.greedy_as_plain(target, NAME, accepted=0.5)


def _reference(w: dict, config: dict, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """vLLM's MiMo MTP step over pairs at positions 0..L-1 (causal), from the published tensors `w` (prefix off), in
    plain MLX operations: the embedding at position 0 zeroed; input_proj(concat[hidden_layernorm(h),
    token_layernorm(e)]); a Qwen2 decoder layer (biased q/k/v, RoPE rotate-half with base rope_theta, grouped-query
    attention, SwiGLU MLP); final_layernorm."""
    eps, heads, kv = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads

    rms = mtp_checks.rms_norm(eps)

    def linear(x, name, bias=False):
        return x @ w[name + ".weight"].T + (w[name + ".bias"] if bias else 0)

    def rope(x):  # [B, n, L, d]: every dim rotated
        return mtp_checks.rotate_half(x, config["rope_theta"], d)

    B, L, _ = embeddings.shape
    embeddings = mx.concatenate([mx.zeros_like(embeddings[:, :1]), embeddings[:, 1:]], axis=1)
    x = linear(mx.concatenate([rms(hidden, w["hidden_layernorm.weight"]), rms(embeddings, w["token_layernorm.weight"])],
                              axis=-1), "input_proj")
    h = rms(x, w["input_layernorm.weight"])
    q, k, v = (linear(h, f"self_attn.{p}_proj", bias=True).reshape(B, L, n, d).transpose(0, 2, 1, 3)
               for p, n in (("q", heads), ("k", kv), ("v", kv)))
    q, k = rope(q), rope(k)
    k, v = mx.repeat(k, heads // kv, axis=1), mx.repeat(v, heads // kv, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + mx.triu(mx.full((L, L), -mx.inf), k=1)
    attn = (mx.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, L, heads * d)
    x = x + linear(attn, "self_attn.o_proj")
    h = rms(x, w["post_attention_layernorm.weight"])
    gate = linear(h, "mlp.gate_proj")
    x = x + linear(gate * mx.sigmoid(gate) * linear(h, "mlp.up_proj"), "mlp.down_proj")
    return rms(x, w["final_layernorm.weight"])


def test_the_head_computes_the_published_step(target):
    """The head as loaded here against `_reference` on a prompt's pairs (a distilled prompt then 40 held-out tokens):
    in one read without a cache, and read in chunks of 8 into its cache then stepped 3 times on its own drafts (the
    reference rerun over the whole sequence each time): the same hidden states within float32 rounding and the
    same draft tokens."""
    mtp_checks.computes_the_reference(target, MTP, load_head, _reference, 40)


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    mtp_checks.draws_through_the_shared_rule(target, load_head)
