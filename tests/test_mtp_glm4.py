"""Speculation with the nextn (MTP) layers GLM-4.5 / 4.6 / 4.7 (`glm4_moe`) and DeepSeek-V3.2 (`deepseek_v32`) ship
inside their checkpoints (issue 42), through the real engine.

Each fixture is a tiny target in the published layout with its nextn layer as `model.layers.<num_hidden_layers>.*`
shipping its own embed_tokens and shared_head.head, distilled briefly on its target: glm4_moe's layer is grouped-query
attention (partial RoPE, q/k norms, biased q/k/v) + MoE; deepseek_v32's is MLA with DSA's indexer (index_topk 8) +
MoE. Greedy output must equal plain decoding; sampled output must be distributed as plain sampling."""

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

