"""Speculation with a MuseGlimmer DFlash assistant (mlx-vlm's muse_glimmer_assistant: a DFlash drafter whose block
queries see only the context within its sliding window) on a Muse Glimmer target, through the real engine (issue 42).

The fixture (`muse_glimmer-dflash-tiny`) is a tiny Muse Glimmer (mlx-lm's muse_glimmer: gated attention, three
sliding layers of window 16 and a global one, an output multiplier and a softcap) with a 2-layer assistant of window 24
on its layers 1 and 2, distilled for seconds. What is this drafter's own: the window (its context cache holds the last
24 positions, the block's queries see those within 24 of them), the layout (top-level keys with mlx-vlm's defaults,
`encoder.*` names, one tapped layer a layer) and the raw embedding and LM head of the target. The rest of DFlash is
tests/test_dflash.py's."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from provider.engine.dflash_drafter import DFlashDrafter
from provider.jobs import SamplingParams
from provider.models import capability
from provider.drafters.dflash import config as dflash
from provider.drafters.dflash.head import DFlashHead, WindowedContext, target_embedding
from tools.fixtures.dflash import drafter_dir
from tools.fixtures.mtp import train_prompts
from provider.drafters.dflash.kind import KIND as DFLASH
from tests import drafter_checks, mtp_checks
from tests.drafter_checks import broken

NAME = "muse_glimmer-dflash-tiny"
WINDOW = 24


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


load_head = drafter_checks.load_dflash_beside


def test_paired_as_dflash_listed_and_registered(target):
    drafter_checks.paired_listed_and_registered(target, NAME, drafter_dir(target), "dflash")
    flat = dflash.flat_config(capability.read_config(drafter_dir(target)))
    assert (flat["variant"], flat["context_window"], flat["rope_theta"], flat["rope_traditional"]) == \
        ("muse_glimmer", WINDOW, 500000.0, False)


def _without(key):
    return lambda c: {k: v for k, v in c.items() if k != key}


BROKEN = {
    "fewer tapped layers than layers": ({"config": lambda c: c | {"target_layer_ids": [1]}},
                                        "taps one target layer per layer: [1] for 2"),
    "full-attention layers": ({"config": lambda c: c | {"layer_types": ["full_attention"] * 2}},
                              "one sliding_attention layer type per layer"),
    "no window": ({"config": lambda c: c | {"sliding_window": 0}}, "sliding_window is 0"),
    "the published target's layer count": ({"config": _without("num_target_layers")},
                                           "num_target_layers 52 != the target's 4 layers"),
    "the published mask token": ({"config": _without("mask_token_id")}, "mask_token_id 201818"),
    "KV heads not dividing heads": ({"config": lambda c: c | {"num_key_value_heads": 3}}, "not a multiple"),
    "a draft window": ({"config": lambda c: c | {"draft_window_size": 8}}, "draft window"),
    "no encoder norm": ({"tensors": lambda w: {k: v for k, v in w.items() if "output_norm_enc" not in k}},
                        "has no tensor hidden_norm.weight"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_assistant_is_refused(target, tmp_path, case):
    change, why = BROKEN[case]
    drafter_checks.refused(target, broken(drafter_dir(target), tmp_path / "bad", **change), why)


def test_it_drafts_for_muse_glimmer_targets_only(target):
    config = capability.read_config(drafter_dir(target))
    qwen3 = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 384, "num_hidden_layers": 4}
    assert "does not draft for qwen3 targets" in dflash.check_pair(qwen3, drafter_dir(target), config)


def test_a_refused_assistant_leaves_the_target_served_plain(target, tmp_path):
    bad = broken(drafter_dir(target), tmp_path / "bad", config=lambda c: c | {"layer_types": ["full_attention"] * 2})
    drafter_checks.served_plain(target, NAME, bad)


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out of 1 to 90 tokens (past both windows), alone then 8 at once, k = 3:
    plain decoding's tokens, every job speculating, over half the distilled prompts' drafts accepted."""
    drafter_checks.greedy_as_plain(target, NAME, drafter_dir(target))


def test_sampled_rounds_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_dflash)."""
    params = SamplingParams(max_tokens=6, temperature=0.03, top_p=0.95, top_k=32, seed=3)
    mtp_checks.draws_through_the_shared_rule(target, load_head, train_prompts()[0], params, drafter=DFlashDrafter)


def test_the_assistant_drafts_as_mlx_vlms_given_its_context(target):
    """mlx-vlm's MuseGlimmerAssistantDraftModel on the same weights, bound to the target's raw embedding and LM head,
    given the whole context so far in one chunk (its cache then holds it in order): the same block logits within 1e-5
    at a 50-token prompt (past the window) and after each later commit of 3, 1, 1 and 2 positions, the node's
    context cache holding the last 24 positions all along. (mlx-vlm's own incremental cache, fed one position after
    its window has filled, rotates in place and its mask then labels the slots by their physical order: its logits
    differed here by 1.07 there, and agreed again after a commit of 2.)"""
    from mlx_vlm.speculative.drafters import muse_glimmer_assistant as family

    model, _ = load(str(target))
    ours = load_head(target, model)
    config = json.loads((drafter_dir(target) / "config.json").read_text())
    theirs = family.Model(family.ModelConfig.from_dict(config))
    theirs.load_weights(list(mx.load(str(drafter_dir(target) / "model.safetensors")).items()), strict=True)
    theirs.embed_tokens, theirs.lm_head = model.model.embed_tokens, model.lm_head  # its bind, without its check of
    embed, lm_head = target_embedding(model)  # mlx-vlm's own Muse target class
    cache, seen, k = ours.make_cache(), [], 4
    for chunk in (list(range(3, 53)), [77, 5, 9], [12], [13], [14, 15]):
        model(mx.array([chunk]))  # fresh features stand in for a verify's
        ours.context(ours.tap.last, cache, cache[0].offset)
        seen.append(ours.tap.last)
        whole, offset = mx.concatenate(seen, axis=1), cache[0].offset
        assert offset == whole.shape[1] and cache[0].keys.shape[2] == min(offset, WINDOW)
        a = ours.logits(ours.block(embed(mx.array([[77] + [ours.mask_token_id] * k])), cache, offset)[:, 1:], lm_head)
        b = theirs.draft_block(77, whole, theirs.make_cache(), k + 1, lambda x: x)
        assert mx.allclose(a, b, atol=1e-5).item(), (offset, mx.abs(a - b).max().item())


def test_the_books_are_what_loads(target):
    """The assistant's weights as loaded and its activations; its context K/V booked as a sliding-window layer's
    (2 layers, K and V, 2 KV heads of 16, float32, window 24), which is what its cache holds after a long prompt."""
    drafter = drafter_dir(target)
    model, head, config = drafter_checks.weights_and_activations_booked(target, drafter, load_head, dflash,
                                                                        DFlashHead)
    shape = DFLASH.kv_shape(drafter, config)
    assert (shape.bytes_per_token_full, shape.bytes_per_token_sliding, shape.sliding_window) == \
        (0, 2 * 2 * 2 * 16 * 4, WINDOW)
    cache = head.make_cache()
    head.context(mx.zeros((1, 90, 2 * 64)), cache, 0)
    assert all(isinstance(c, WindowedContext) and c.offset == 90 for c in cache)  # only the last 24 projected
    assert sum(c.keys.nbytes + c.values.nbytes for c in cache) == WINDOW * shape.bytes_per_token_sliding
    drafter_checks.node_books_the_drafter(target, NAME, drafter, DFlashHead, DFLASH.kv_shape)


def test_grammar_rows_speculate_with_the_assistant_as_plain_decoding_together(target):
    drafter_checks.grammar_rows_as_plain_together(target, NAME, drafter_dir(target))
