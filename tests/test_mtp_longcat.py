"""Speculation with the MTP layer Meituan LongCat-Flash ships inside its checkpoint (issue 42), through the real engine.

The fixture is a tiny longcat_flash (layers of two MLAs and two dense MLPs around a MoE with identity zero experts)
in the published layout with its MTP layer as `model.mtp.*` (its own embed_tokens, eh_proj, enorm.m / hnorm.m, one
dense MLA layer, norm), distilled briefly on its target. mlx-vlm 0.7.10 has no LongCat drafter: the head is checked
against vLLM's step written here in plain MLX operations. Greedy output must equal plain decoding; sampled output
must be distributed as plain sampling."""

import json

import mlx.core as mx
import pytest

from provider.drafters.mtp.longcat_flash import load_head
from tests import mtp_checks

NAME = "longcat_flash-mtp-tiny"
MTP = "model.mtp."


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_mtp_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith(MTP))
    # mlx-lm's sanitize drops the layer; the head (its own embedding, the target's LM head) is booked once. Its
    # cache a token: the normed latent (32) and the rotated k_pe (8), float32.
    head = mtp_checks.books_as_held(target, config, load_head, (32 + 8) * 4, own_parts=True, own_lm_head=False)

    # Two MTP layers declared and shipped: served with the first, which alone is read and booked.
    def second_layer(w):
        return w | {k.replace(".layers.0.", ".layers.1.", 1): v * 2 for k, v in w.items()
                    if k.startswith(MTP + "layers.0.")}

    loaded = mtp_checks.first_layer_alone(target, tmp_path / "two", second_layer, {"num_nextn_predict_layers": 2},
                                          load_head)

    # The published config declares no MTP layer (transformers' LongcatFlashConfig has no such key; vLLM assumes
    # one): its tensors decide, found with them and not without.
    bare = {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}
    (undeclared := tmp_path / "undeclared").mkdir()
    for f in target.iterdir():
        (undeclared / f.name).write_bytes(f.read_bytes())
    (undeclared / "config.json").write_text(json.dumps(bare))
    mtp_checks.found_but_not_when_stripped(undeclared, tmp_path / "undeclared-stripped", lambda k: k.startswith(MTP))
    assert mx.array_equal(loaded.eh_proj.weight, head.eh_proj.weight).item()  # layer 0's


@pytest.mark.parametrize("broken", ["eh_proj cut", "kv_b_proj gone", "hnorm gone"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """eh_proj cut, MLA's kv_b_proj or hnorm gone: refused at load and the target served plain
    (mtp_checks.refused_when_broken)."""
    drop = {"kv_b_proj gone": MTP + "layers.0.self_attn.kv_b_proj", "hnorm gone": MTP + "layers.0.hnorm."}
    mtp_checks.refused_when_broken(target, tmp_path / "bad", NAME, load_head, broken, MTP + "layers.0.eh_proj.weight",
                                   drop)


def test_a_quantized_head_is_refused_at_load_and_the_target_still_served(target, tmp_path):
    """eh_proj shipped quantized (weight, scales, biases): the head's layers are float ones, so the load refuses it
    ("parameters not in model") and the target is served plain."""
    name = MTP + "layers.0.eh_proj."

    def quantized(w):
        q, scales, biases = mx.quantize(w[name + "weight"], group_size=64, bits=4)
        return w | {name + "weight": q, name + "scales": scales, name + "biases": biases}

    mtp_checks.refused_and_served_plain(mtp_checks.rewritten(target, tmp_path / "q", quantized), target, NAME,
                                        load_head)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens alone then 8 together: plain decoding's tokens, and on the prompts the head was
    distilled on, most drafts accepted."""
    mtp_checks.greedy_as_plain(target, NAME, accepted=0.5)


def _reference(w: dict, config: dict, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """vLLM's LongCat-Flash MTP step (LongCatMultiTokenPredictorLayer) over pairs at positions 0..L-1, from the
    published tensors `w` (`model.mtp.` off), in plain MLX operations: eh_proj(concat[enorm(e), hnorm(h)]); a dense
    DeepSeek-V2 layer: MLA (q through q_a, its norm scaled by sqrt(H / q_lora_rank), q_b; the latent normed and
    scaled by sqrt(H / kv_lora_rank), expanded by kv_b_proj into per-head K (nope) and V; interleaved RoPE of base
    rope_theta on the rope dims, k_pe shared by the heads), SwiGLU MLP; then the MTP norm."""
    eps, heads, H = config["rms_norm_eps"], config["num_attention_heads"], config["hidden_size"]
    nope, rot, vd = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    rms = mtp_checks.rms_norm(eps)
    layer = "layers.0."

    def linear(x, name):
        return x @ w[layer + name + ".weight"].T

    def rope(x):  # [B, n, L, d]: pairs (2i, 2i + 1) rotated, as DeepSeek's (and mlx-lm's traditional) RoPE
        angles = mx.arange(x.shape[2])[:, None] * (config["rope_theta"] ** (-mx.arange(0, rot, 2) / rot))[None]
        cos, sin = mx.cos(angles), mx.sin(angles)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)

    B, L, _ = embeddings.shape
    x = linear(mx.concatenate([rms(embeddings, w[layer + "enorm.m.weight"]), rms(hidden, w[layer + "hnorm.m.weight"])],
                              axis=-1), "eh_proj")
    h = rms(x, w[layer + "input_layernorm.weight"])
    q = rms(linear(h, "self_attn.q_a_proj"), w[layer + "self_attn.q_a_layernorm.weight"]) * (
        H / config["q_lora_rank"]) ** 0.5
    q = linear(q, "self_attn.q_b_proj").reshape(B, L, heads, nope + rot).transpose(0, 2, 1, 3)
    latent, k_pe = mx.split(linear(h, "self_attn.kv_a_proj_with_mqa"), [config["kv_lora_rank"]], axis=-1)
    latent = rms(latent, w[layer + "self_attn.kv_a_layernorm.weight"]) * (H / config["kv_lora_rank"]) ** 0.5
    kv = linear(latent, "self_attn.kv_b_proj").reshape(B, L, heads, nope + vd).transpose(0, 2, 1, 3)
    k_pe = mx.broadcast_to(rope(k_pe.reshape(B, 1, L, rot)), (B, heads, L, rot))
    q = mx.concatenate([q[..., :nope], rope(q[..., nope:])], axis=-1)
    k, v = mx.concatenate([kv[..., :nope], k_pe], axis=-1), kv[..., nope:]
    scores = q @ k.transpose(0, 1, 3, 2) * (nope + rot) ** -0.5 + mx.triu(mx.full((L, L), -mx.inf), k=1)
    x = x + linear((mx.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, L, heads * vd),
                   "self_attn.o_proj")
    h = rms(x, w[layer + "post_attention_layernorm.weight"])
    mlp = "transformer_layer.mlp."
    gate = linear(h, mlp + "gate_proj")
    x = x + linear(gate * mx.sigmoid(gate) * linear(h, mlp + "up_proj"), mlp + "down_proj")
    return rms(x, w["norm.weight"])


def test_the_head_computes_the_published_step(target):
    """The head as loaded here against `_reference` on a prompt's pairs (a distilled prompt then 40 held-out tokens):
    in one read without a cache, and read in chunks of 8 into its cache then stepped 3 times on its own drafts (the
    reference rerun over the whole sequence each time): the same hidden states within float32 rounding and the
    same draft tokens. It embeds with the layer's own embed_tokens."""
    mtp_checks.computes_the_reference(target, MTP, load_head, _reference, 40, own_parts=True)


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule."""
    mtp_checks.draws_through_the_shared_rule(target, load_head)
