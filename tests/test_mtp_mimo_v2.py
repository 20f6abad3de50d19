"""Speculation with the first MTP layer Xiaomi MiMo-V2-Flash ships inside its checkpoint (issue 42), through the real
engine.

The fixture is a tiny mimo_v2_flash (full and sliding-window attention layers, window 8, sinks, MoE) in the published
layout with its MTP layer as `model.mtp.layers.0.*` (sliding-window attention with sinks, dense MLP), distilled
briefly on its target. mlx-vlm 0.7.10 has no MiMo-V2 drafter. Greedy output must equal plain decoding; sampled
output must be distributed as plain sampling."""

import mlx.core as mx
import pytest

from provider.jobs import SamplingParams
from provider.models.fixtures_mtp import train_prompts
from provider.models.footprint import head_kv_shape
from provider.models.mimo_v2_mtp import load_head
from tests import mtp_checks

NAME = "mimo_v2_flash-mtp-tiny"
MTP = "model.mtp.layers.0."


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_mtp_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith("model.mtp."))
    _, head = mtp_checks.booked_once(target, config, load_head)
    assert head.lm_head is None and "embed_tokens" not in head  # the target's are used
    # 2 KV heads a token, keys of 16 and values of 8 (the sliding layers' sizes), float32; every position kept.
    assert head_kv_shape(target, config).bytes_per_token_full == 2 * (16 + 8) * 4
    cache = head.make_cache()
    head(mx.zeros((1, 12, 64)), mx.zeros((1, 12, 64)), cache)
    assert sum(x[..., :12, :].nbytes for x in (cache[0].keys, cache[0].values)) == 12 * 2 * (16 + 8) * 4


@pytest.mark.parametrize("broken", ["eh_proj cut", "sinks gone", "pre_mlp_layernorm gone"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """The header still says a head is there (capability holds); the load refuses it cleanly, and the node decodes
    plain with the reason (auto), its output plain decoding's."""
    drop = {"sinks gone": MTP + "self_attn.attention_sink_bias", "pre_mlp_layernorm gone": MTP + "pre_mlp_layernorm"}
    change = {
        "eh_proj cut": lambda w: w | {MTP + "eh_proj.weight": w[MTP + "eh_proj.weight"][:, :127]},
    }.get(broken, lambda w: {k: v for k, v in w.items() if not k.startswith(drop[broken])})
    mtp_checks.refused_and_served_plain(mtp_checks.rewritten(target, tmp_path / "bad", change), target, NAME, load_head)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens (most past the window of 8) alone, then 8 together: plain decoding's tokens, and on
    the prompts the head was distilled on, most drafts accepted."""
    _, alone, _ = mtp_checks.greedy_as_plain(target, NAME)
    spec = [done.telemetry.speculation for _, _, done, _ in alone[:4]]
    assert sum(s.accepted for s in spec) > 0.4 * sum(s.judged for s in spec), spec


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


def test_sampled_rounds_with_the_head_are_distributed_as_plain_sampling(target):
    """The distribution test (mtp_checks.sampled_as_plain): the first 6 tokens at T = 0.7 with top_p and top_k,
    k = 3, 800 samples a side, both branches hundreds of times; and its biased control told apart."""
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, top_k=32, seed=3)
    mtp_checks.sampled_as_plain(target, load_head, train_prompts()[0], params)
