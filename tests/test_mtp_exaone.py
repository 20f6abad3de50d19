"""Speculation with the MTP layer LG K-EXAONE (`exaone_moe`) ships inside its checkpoint (issue 42), through the real
engine.

The fixture is a tiny exaone_moe (sliding-window and global layers, window 8, q/k norms, MoE) in the published layout
with its MTP layer as `mtp.*` (a sliding-window layer with a dense MLP), distilled briefly on its target. mlx-vlm
0.7.10 has no EXAONE drafter: the head is checked against vLLM's step written here in plain MLX operations. Greedy
output must equal plain decoding; sampled output must be distributed as plain sampling."""

import mlx.core as mx
import pytest
from mlx_lm import load

from provider.drafters.mtp.exaone_moe import load_head
from tests import mtp_checks

NAME = "exaone_moe-mtp-tiny"
MTP = "mtp."


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_mtp_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith(MTP))
    # K and V, 2 KV heads of 16, float32, a token; every position kept (12 pairs, past the window). The target's
    # embedding and LM head.
    mtp_checks.books_as_held(target, config, load_head, 2 * 2 * 16 * 4, own_parts=False, pairs=12)
    # A layer clamped at swiglu_limits[0] (vLLM's MTP MLP), which mlx-lm's MLP cannot do: refused at load.
    clamped = mtp_checks.rewritten(target, tmp_path / "clamped", dict, {"swiglu_limits": [7.0, 0, 0, 0]})
    with pytest.raises(ValueError):
        load_head(clamped, load(str(clamped))[0])


@pytest.mark.parametrize("broken", ["fc cut", "k_norm gone", "norm gone"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """fc cut, a k_norm or the final norm gone: refused at load and the target served plain
    (mtp_checks.refused_when_broken)."""
    drop = {"k_norm gone": MTP + "layers.0.self_attn.k_norm", "norm gone": MTP + "norm."}
    mtp_checks.refused_when_broken(target, tmp_path / "bad", NAME, load_head, broken, MTP + "fc.weight", drop)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens (most past the window of 8) alone, then 8 together: plain decoding's tokens, and on
    the prompts the head was distilled on, most drafts accepted."""
    mtp_checks.greedy_as_plain(target, NAME, accepted=0.5)


def _reference(w: dict, config: dict, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """vLLM's K-EXAONE MTP step (ExaoneMoeMultiTokenPredictor) over pairs at positions 0..L-1, from the published
    tensors `w` (prefix off), in plain MLX operations: fc(concat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]);
    a sliding-window layer (mtp_layer_types[0], window mtp_sliding_windows[0]): per-head q/k norms, rotate-half RoPE
    of base rope_theta, grouped-query attention causal within the window, a dense SwiGLU MLP; then mtp.norm."""
    eps, heads, kv, d = (config[k] for k in ("rms_norm_eps", "num_attention_heads", "num_key_value_heads", "head_dim"))
    window = config["mtp_sliding_windows"][0]

    def norm(x, name):
        return mtp_checks.rms_norm(eps)(x, w[name + ".weight"])

    def linear(x, name):
        return x @ w[name + ".weight"].T

    B, L, _ = embeddings.shape
    x = linear(mx.concatenate([norm(embeddings, "pre_fc_norm_embedding"), norm(hidden, "pre_fc_norm_hidden")],
                              axis=-1), "fc")
    h = norm(x, "layers.0.input_layernorm")
    q, k, v = (linear(h, f"layers.0.self_attn.{p}_proj").reshape(B, L, n, d) for p, n in (("q", heads), ("k", kv),
                                                                                         ("v", kv)))
    q, k = norm(q, "layers.0.self_attn.q_norm"), norm(k, "layers.0.self_attn.k_norm")
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    q, k = (mtp_checks.rotate_half(t, config["rope_theta"], d) for t in (q, k))
    k, v = mx.repeat(k, heads // kv, axis=1), mx.repeat(v, heads // kv, axis=1)
    a, b = mx.arange(L)[:, None], mx.arange(L)[None]
    scores = mx.where((b <= a) & (a - b < window), q @ k.transpose(0, 1, 3, 2) * d ** -0.5, -mx.inf)
    x = x + linear((mx.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, L, heads * d),
                   "layers.0.self_attn.o_proj")
    h = norm(x, "layers.0.post_attention_layernorm")
    gate = linear(h, "layers.0.mlp.gate_proj")
    x = x + linear(gate * mx.sigmoid(gate) * linear(h, "layers.0.mlp.up_proj"), "layers.0.mlp.down_proj")
    return norm(x, "norm")


def test_the_head_computes_the_published_step(target):
    """The head as loaded here against `_reference` on a prompt's pairs (a distilled prompt then 30 held-out tokens,
    past the window): in one read without a cache, and read in chunks of 8 into its cache then stepped 3 times on
    its own drafts (the reference rerun each time): the same hidden states within float32 rounding, the same drafts."""
    mtp_checks.computes_the_reference(target, MTP, load_head, _reference, 30)


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    mtp_checks.draws_through_the_shared_rule(target, load_head)
