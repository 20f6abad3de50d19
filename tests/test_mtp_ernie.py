"""Speculation with the MTP layer Baidu ERNIE-4.5 MoE ships inside its checkpoint (issue 42), through the real engine.

The fixture is a tiny ernie4_5_moe (a dense layer then MoE layers with a shared expert) in the published layout with
its MTP layer as `model.mtp_{emb_norm,hidden_norm,linear_proj,block}.0.*`, distilled briefly on its target. mlx-vlm
0.7.10 has no ERNIE drafter: the head is checked against SGLang's step written here in plain MLX operations. Greedy
output must equal plain decoding; sampled output must be distributed as plain sampling."""

import mlx.core as mx
import pytest

from provider.drafters.mtp.ernie4_5 import load_head
from tests import mtp_checks

NAME = "ernie4_5_moe-mtp-tiny"
MTP = ("model.mtp_emb_norm.0.", "model.mtp_hidden_norm.0.", "model.mtp_linear_proj.0.", "model.mtp_block.0.")


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_mtp_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith(MTP))
    # mlx-lm's sanitize drops the layer (the target's books hold none of it); the head is booked once. K and V, 2 KV
    # heads of 16, float32, a token: what the head's cache holds after 5 pairs. The target's embedding and LM head.
    head = mtp_checks.books_as_held(target, config, load_head, 2 * 2 * 16 * 4, own_parts=False)

    # Two MTP layers declared and shipped: served with the first, which alone is read and booked.
    def second_layer(w):
        return w | {k.replace(".0.", ".1.", 1): v * 2 for k, v in w.items() if k.startswith(MTP)}

    loaded = mtp_checks.first_layer_alone(target, tmp_path / "two", second_layer, {"num_nextn_predict_layers": 2},
                                          load_head)
    assert mx.array_equal(loaded.mtp_linear_proj.weight, head.mtp_linear_proj.weight).item()  # layer 0's


@pytest.mark.parametrize("broken", ["mtp_linear_proj cut", "k_proj gone", "mtp_hidden_norm gone"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """mtp_linear_proj cut, a k_proj or mtp_hidden_norm gone: refused at load and the target served plain
    (mtp_checks.refused_when_broken)."""
    drop = {"k_proj gone": "model.mtp_block.0.self_attn.k_proj", "mtp_hidden_norm gone": "model.mtp_hidden_norm.0."}
    mtp_checks.refused_when_broken(target, tmp_path / "bad", NAME, load_head, broken, "model.mtp_linear_proj.0.weight",
                                   drop)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens alone then 8 together: plain decoding's tokens, and on the prompts the head was
    distilled on, most drafts accepted."""
    mtp_checks.greedy_as_plain(target, NAME, accepted=0.5)


def _reference(w: dict, config: dict, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """SGLang's ERNIE-4.5 MTP step (Ernie4ModelMTP) over pairs at positions 0..L-1, from the published tensors `w`
    (`model.` off, the parts' `.0.` kept), in plain MLX operations: the embedding at position 0 zeroed;
    mtp_linear_proj(concat[mtp_emb_norm(e), mtp_hidden_norm(h)]); a dense decoder layer (grouped-query attention
    with interleaved RoPE of base rope_theta, SwiGLU MLP); its output as it is (no norm before the LM head)."""
    eps, heads, kv, d = (config[k] for k in ("rms_norm_eps", "num_attention_heads", "num_key_value_heads", "head_dim"))
    rms = mtp_checks.rms_norm(eps)

    def linear(x, name):
        return x @ w[name + ".weight"].T

    def rope(x):  # [B, n, L, d]: pairs (2i, 2i + 1) rotated, as ERNIE's (and mlx-lm's traditional) RoPE
        angles = mx.arange(x.shape[2])[:, None] * (config["rope_theta"] ** (-mx.arange(0, d, 2) / d))[None]
        cos, sin = mx.cos(angles), mx.sin(angles)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)

    B, L, _ = embeddings.shape
    block = "mtp_block.0."
    embeddings = mx.concatenate([mx.zeros_like(embeddings[:, :1]), embeddings[:, 1:]], axis=1)
    x = linear(mx.concatenate([rms(embeddings, w["mtp_emb_norm.0.weight"]), rms(hidden, w["mtp_hidden_norm.0.weight"])],
                              axis=-1), "mtp_linear_proj.0")
    h = rms(x, w[block + "input_layernorm.weight"])
    q, k, v = (linear(h, f"{block}self_attn.{p}_proj").reshape(B, L, n, d).transpose(0, 2, 1, 3)
               for p, n in (("q", heads), ("k", kv), ("v", kv)))
    q, k = rope(q), rope(k)
    k, v = mx.repeat(k, heads // kv, axis=1), mx.repeat(v, heads // kv, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * d ** -0.5 + mx.triu(mx.full((L, L), -mx.inf), k=1)
    x = x + linear((mx.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, L, heads * d),
                   block + "self_attn.o_proj")
    h = rms(x, w[block + "post_attention_layernorm.weight"])
    gate = linear(h, block + "mlp.gate_proj")
    return x + linear(gate * mx.sigmoid(gate) * linear(h, block + "mlp.up_proj"), block + "mlp.down_proj")


def test_the_head_computes_the_published_step(target):
    """The head as loaded here against `_reference` on a prompt's pairs (a distilled prompt then 40 held-out tokens):
    in one read without a cache, and read in chunks of 8 into its cache then stepped 3 times on its own drafts (the
    reference rerun over the whole sequence each time): the same hidden states within float32 rounding and the
    same draft tokens."""
    mtp_checks.computes_the_reference(target, "model.", load_head, _reference, 40)


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    mtp_checks.draws_through_the_shared_rule(target, load_head)
