"""Speculation with a Gemma 4 DFlash drafter (mlx-vlm's gemma4_dflash: a DFlash drafter whose config is
`model_type: gemma4`, its mask token 4 by default) on a Gemma 4 target, through the real engine (issue 42).

The fixture (`gemma4-dflash-tiny`) is fixtures' tiny Gemma 4 (sliding and full layers, a KV-shared tail, per-layer
inputs, a 32-token window) with a drafter on its layers 2 (full) and 4 (KV-shared sliding), distilled for seconds.
What is Gemma's own: the block's embeddings scaled by sqrt(H) as the target scales its input, the layer taps on
decoder layers that return (h, shared K/V, offset), and the drafter's final softcap. The rest of DFlash is
tests/test_dflash.py's."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from provider.engine.dflash_drafter import DFlashDrafter
from provider.jobs import SamplingParams
from provider.drafters.dflash import config as dflash
from provider.drafters.dflash.head import DFlashHead, target_embedding
from tools.fixtures.dflash import drafter_dir
from tools.fixtures.mtp import train_prompts
from provider.drafters.dflash.kind import KIND as DFLASH
from tests import drafter_checks, mtp_checks
from tests.drafter_checks import broken

NAME = "gemma4-dflash-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


load_head = drafter_checks.load_dflash_beside


def test_paired_as_dflash_listed_and_registered(target):
    drafter_checks.paired_listed_and_registered(target, NAME, drafter_dir(target), "dflash")
    assert dflash.flat_config(json.loads((drafter_dir(target) / "config.json").read_text()))["mask_token_id"] == 4


BROKEN = {
    "misshaped fc": ({"tensors": lambda w: w | {"fc.weight": w["fc.weight"][:, :127]}}, "fc.weight is [64, 127]"),
    "layer ids out of range": ({"config": lambda c: c | {"dflash_config": {"target_layer_ids": [2, 6]}}},
                               "target layer ids [2, 6]"),
    "mask id outside the vocabulary": ({"config": lambda c: c | {"dflash_config": c["dflash_config"] | {
        "mask_token_id": 512}}}, "mask_token_id 512"),
    "labelled Gemma 4 DSpark": ({"config": lambda c: c | {"architectures": ["Gemma4DSparkModel"]}},
                                "mask_token_id None is not a token"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_drafter_is_refused(target, tmp_path, case):
    change, why = BROKEN[case]
    drafter_checks.refused(target, broken(drafter_dir(target), tmp_path / "bad", **change), why)


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    bad = broken(drafter_dir(target), tmp_path / "bad", config=lambda c: c | {"num_target_layers": 36})
    drafter_checks.served_plain(target, NAME, bad)


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out of 1 to 90 tokens (past the target's 32-token window), alone then
    8 at once, k = 3: plain decoding's tokens. Alone, over half the distilled prompts' drafts are accepted. Together
    their prefixes come from the prefix cache and the drafter's context skips them: this tiny drafter, which learnt
    its training sequences, drafts those rows poorly (lossless, as test_dflash's)."""
    drafter_checks.greedy_as_plain_accepted_alone(target, NAME, drafter_dir(target))


def test_sampled_rounds_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_dflash)."""
    params = SamplingParams(max_tokens=6, temperature=0.05, top_p=0.95, top_k=32, seed=3)
    mtp_checks.draws_through_the_shared_rule(target, load_head, train_prompts()[0], params, drafter=DFlashDrafter)


def test_the_drafter_drafts_as_mlx_vlms_gemma4_dflash_drafter(target):
    """mlx-vlm's Gemma4DFlashDraftModel bound to the same target (its embed_scale read from the target) on the same
    tapped layers: the same block logits, softcapped, within 1e-4."""
    from mlx_vlm.speculative.drafters.gemma4_dflash import Model, ModelConfig

    model, _ = load(str(target))
    ours = load_head(target, model)
    theirs = Model(ModelConfig.from_dict(json.loads((drafter_dir(target) / "config.json").read_text())))
    theirs.load_weights(list(theirs.sanitize(dict(mx.load(str(drafter_dir(target) / "model.safetensors")))).items()))
    theirs.reset(model)
    assert theirs.embed_scale == 8.0 and theirs.config.mask_token_id == ours.mask_token_id == 4
    ids = mx.array([train_prompts()[1] + list(range(40, 80))])  # past the window
    model(ids)
    features, embed = ours.tap.last, target_embedding(model)
    cache, k = ours.make_cache(), 4
    ours.context(features, cache, 0)
    a = ours.logits(ours.block(embed[0](mx.array([[77] + [4] * k])), cache, ids.shape[1])[:, 1:], embed[1])
    b = theirs.draft_block(77, features, theirs.make_cache(), k + 1, lambda x: x)
    assert mx.allclose(a, b, atol=1e-4).item() and mx.abs(a).max().item() <= 30.0


def test_the_books_are_what_loads(target):
    """The drafter's weights as loaded, its activations, its context KV per token (2 layers, K and V, one KV head
    of 16, float32), and through the node."""
    drafter = drafter_dir(target)
    drafter_checks.weights_and_activations_booked(target, drafter, load_head, dflash, DFlashHead)
    assert DFLASH.kv_shape(drafter, json.loads((drafter / "config.json").read_text())).bytes_per_token_full == \
        2 * 2 * 1 * 16 * 4
    drafter_checks.node_books_the_drafter(target, NAME, drafter, DFlashHead, DFLASH.kv_shape)
