"""Speculation with a DFlash drafter: a block-diffusion drafter of its own, trained against its target, reading
several of the target's decoder layers and drafting a whole block in one forward (issue 42), through the real engine.

The fixture (fixture factory: `qwen3-dflash-tiny`) is fixtures' tiny Qwen3 target and a drafter in the published
layout beside it (fc, hidden_norm, layers.i.*, norm; dflash_config {mask_token_id, target_layer_ids}), distilled for
seconds on blocks of the target's greedy continuations of the training prompts: drafts on those are accepted often.
Greedy output must equal plain decoding; sampled output must be distributed as plain sampling."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from provider.engine.dflash_drafter import DFlashDrafter
from provider.models import capability
from provider.drafters.dflash import config as dflash
from provider.drafters.dflash.head import DFlashHead
from tools.fixtures.dflash import drafter_dir
from tools.fixtures.mtp import train_prompts
from provider.drafters.dflash.kind import KIND as DFLASH
from provider.proofs.hidden_tap import install_layers
from tests import drafter_checks
from tests.drafter_checks import broken

NAME = "qwen3-dflash-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


load_head = drafter_checks.load_dflash_beside


def test_paired_as_dflash_from_config_and_headers_listed_and_registered(target):
    drafter_checks.paired_listed_and_registered(target, NAME, drafter_dir(target), "dflash")
    # Not taken for an EAGLE-3 drafter, nor an EAGLE-3 one for it.
    from provider.drafters.eagle3.config import is_eagle3
    assert not is_eagle3(capability.read_config(drafter_dir(target)))


def _ids(ids):
    return lambda c: c | {"dflash_config": c["dflash_config"] | {"target_layer_ids": ids}}


BROKEN = {
    "missing q_proj": ({"tensors": lambda w: {k: v for k, v in w.items() if "layers.1.self_attn.q_proj" not in k}},
                       "has no tensor layers.1.self_attn.q_proj"),
    "misshaped fc": ({"tensors": lambda w: w | {"fc.weight": w["fc.weight"][:, :127]}}, "fc.weight is [64, 127]"),
    "layer ids out of range": ({"config": _ids([0, 2])}, "target layer ids [0, 2]"),
    "layer ids descending": ({"config": _ids([1, 0])}, "target layer ids [1, 0]"),
    "three ids for a two-id fc": ({"config": lambda c: _ids([0, 1, 1])(c)}, "target layer ids [0, 1, 1]"),
    "other hidden size": ({"config": lambda c: c | {"hidden_size": 32}}, "hidden_size 32"),
    "other vocabulary": ({"config": lambda c: c | {"vocab_size": 1024}}, "vocab_size 1024"),
    "other target depth": ({"config": lambda c: c | {"num_target_layers": 36}}, "num_target_layers 36"),
    "mask id outside the vocabulary": ({"config": lambda c: c | {"dflash_config": c["dflash_config"] | {
        "mask_token_id": 384}}}, "mask_token_id 384"),
    "truncated file": ({"raw": lambda b: b[:len(b) // 2]}, "unreadable"),
    "quantized": ({"tensors": lambda w: w | {"fc.scales": mx.ones((64, 2))}}, "does not load: fc.scales"),
    "quantized weight": ({"tensors": lambda w: w | {"fc.weight": mx.zeros((64, 128), dtype=mx.uint32)}},
                         "dtype U32"),
    "DSpark without its Markov head": ({"config": lambda c: c | {"architectures": ["DSparkDraftModel"]}},
                                       "has no tensor markov_head.markov_w1.weight"),
    "DFlash2 without its selector": ({"config": lambda c: c | {"architectures": ["DFlash2DraftModel"]}},
                                     "malformed DFlash2 config: conv_kernel_size is 0"),
    "no RoPE base": ({"config": lambda c: c | {"rope_theta": 0}}, "rope_theta is 0"),
    "causal blocks": ({"config": lambda c: c | {"dflash_config": c["dflash_config"] | {"causal": True}}},
                      "causal blocks"),
    # mlx-vlm's Laguna DFlash (model_type laguna with a dflash_config) and MuseGlimmer's assistant (model_type
    # muse_glimmer_assistant, its DFlash keys at the top level): each taken for what it is, and refused when its keys
    # or target are not its own (tests/test_laguna_dflash.py and test_muse_glimmer.py serve them)
    "Laguna": ({"config": lambda c: c | {"model_type": "laguna"}}, "malformed Laguna DFlash config: sliding_window is None"),
    "MuseGlimmer assistant": ({"config": lambda c: {k: v for k, v in c.items() if k != "dflash_config"} | {
        "model_type": "muse_glimmer_assistant", "architectures": ["MuseGlimmerAssistantModel"]} | c["dflash_config"]},
                              "a muse_glimmer drafter does not draft for qwen3 targets"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_drafter_is_refused_at_capability_time(target, tmp_path, case):
    change, why = BROKEN[case]
    drafter_checks.refused(target, broken(drafter_dir(target), tmp_path / "bad", **change), why)


def test_rope_is_read_as_mlx_vlms_dflash_config_reads_it(target):
    """No rope_theta (mlx-vlm's default 1e7, not mlx-lm's 1e4), rope_parameters' theta and scaling, and the
    pairing (rope_is_neox_style): the drafter's RoPE is what mlx-vlm's DFlashConfig builds."""
    from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig

    base = {k: v for k, v in capability.read_config(drafter_dir(target)).items() if k != "rope_theta"}
    for change in ({}, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
                   {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 1e6},
                   {"rope_is_neox_style": False}):
        config = base | change
        flat, theirs = dflash.flat_config(config), DFlashConfig.from_dict(config)
        assert (flat["rope_theta"], flat.get("rope_scaling")) == (theirs.rope_theta, theirs.rope_scaling), change
        assert flat["rope_traditional"] == (not config.get("rope_is_neox_style", True)), change


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    # Refused by its config alone: with the check off it would load and speculate.
    bad = broken(drafter_dir(target), tmp_path / "bad", config=lambda c: c | {"num_target_layers": 36})
    drafter_checks.served_plain(target, NAME, bad)


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out (1 to 90 tokens), alone then 8 at once (their prefixes then cached:
    the drafter's positions skip them), k = 3: plain decoding's tokens, every job speculating, and on the
    distilled prompts over half the drafts accepted (what the target's layers give)."""
    _, together = drafter_checks.greedy_as_plain(target, NAME, drafter_dir(target))
    # Together, some prompts' prefixes came from the prefix cache: the drafter's positions skipped them.
    assert any(done.telemetry.cached_prompt_tokens > 0 for _, _, done, _ in together)


def test_sampled_rounds_are_distributed_as_plain_sampling(target):
    """test_spec_sampling's distribution test (mtp_checks.sampled_as_plain) with the drafter: each draft of a
    block drawn from its own position's q; its biased control (every draft accepted) is caught."""
    drafter_checks.sampled_as_plain(target, load_head, DFlashDrafter)


def _mlx_vlm_drafter(drafter, model):
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel, ModelConfig

    theirs = DFlashDraftModel(ModelConfig.from_dict(json.loads((drafter / "config.json").read_text())))
    weights = dict(mx.load(str(drafter / "model.safetensors")))
    theirs.load_weights(list(theirs.sanitize(weights).items()), strict=True)
    theirs.reset(model)
    return theirs


def test_the_drafter_drafts_as_mlx_vlms_dflash_drafter(target):
    """mlx-vlm's DFlashDraftModel on the same weights, fed the same tapped layers (its target_layer_ids): the same
    block logits within 1e-5 and the same greedy drafts, for a prompt's block and then a second block after three
    more committed positions (its context cache grown by their features), and the same context caches."""
    model, _ = load(str(target))
    ours = load_head(target, model)
    theirs = _mlx_vlm_drafter(drafter_dir(target), model)
    assert list(theirs.config.target_layer_ids) == list(ours.tap.layers) == [0, 1]
    ids = mx.array([train_prompts()[1] + list(range(40, 60))])
    model(ids)
    features = ours.tap.last
    embed, k, mask = model.model.embed_tokens, 4, ours.mask_token_id
    mine, their_cache = ours.make_cache(), theirs.make_cache()
    L = ids.shape[1]
    ours.context(features, mine, 0)
    bonus = 77
    a = ours.logits(ours.block(embed(mx.array([[bonus] + [mask] * k])), mine, L)[:, 1:], embed.as_linear)
    b = theirs.draft_block(bonus, features, their_cache, k + 1, lambda x: x)
    assert a.shape == b.shape == (1, k, 384) and mx.allclose(a, b, atol=1e-5).item()
    assert mx.argmax(a, -1).tolist() == mx.argmax(b, -1).tolist()
    more = mx.array([[bonus, 5, 9]])
    model(more)  # no cache: the tap's features of three fresh positions stand in for a verify's
    f2 = ours.tap.last
    ours.context(f2, mine, L)
    a = ours.logits(ours.block(embed(mx.array([[11] + [mask] * k])), mine, L + 3)[:, 1:], embed.as_linear)
    b = theirs.draft_block(11, f2, their_cache, k + 1, lambda x: x)
    assert mx.allclose(a, b, atol=1e-5).item()
    for c, t in zip(mine, their_cache):
        assert c.offset == t.offset == L + 3
        assert mx.allclose(c.keys[..., :c.offset, :], t.keys[..., :t.offset, :], atol=1e-5).item()


def test_rows_of_different_contexts_draft_together_as_each_alone(target):
    """Three rows whose contexts hold 3, 9 and 1 positions (at positions that skip 0, 4 and 2 for a cached prefix):
    one batched block forward (contexts left-padded and masked) gives each row's logits of its own forward."""
    model, _ = load(str(target))
    head = load_head(target, model)
    embed, k = model.model.embed_tokens, 3
    caches, offsets = [], []
    for n, skip in ((3, 0), (9, 4), (1, 2)):
        cache = head.make_cache()
        head.context(mx.random.normal((1, n, 128)), cache, skip)
        caches.append(cache)
        offsets.append(skip + n)
    tokens = mx.array([[t] + [head.mask_token_id] * k for t in (5, 77, 300)])
    together = head.block_rows(embed(tokens), caches, offsets)
    for i, (cache, offset) in enumerate(zip(caches, offsets)):
        alone = head.block(embed(tokens[i:i + 1]), cache, offset)
        assert mx.allclose(together[i:i + 1], alone, atol=1e-5).item(), i


def test_the_books_are_what_loads(target):
    """Booked: the drafter's weights as it holds them loaded, its activations, and its context KV per token as its
    cache holds it; the target's layer tap only with the drafter."""
    drafter = drafter_dir(target)
    model, head, config = drafter_checks.weights_and_activations_booked(target, drafter, load_head, dflash, DFlashHead)
    cache = head.make_cache()
    head.context(mx.zeros((1, 5, 128)), cache, 0)
    per_token = 2 * 2 * 2 * 16 * 4  # 2 layers, K and V, 2 KV heads x 16, float32
    assert sum(x[..., :5, :].nbytes for c in cache for x in (c.keys, c.values)) == 5 * per_token
    assert DFLASH.kv_shape(drafter, config).bytes_per_token_full == per_token
    assert install_layers(model, [0, 1]) is head.tap  # installed once, by the drafter's load


def test_the_node_books_the_drafter_it_loads(target):
    """Through the residency: the drafter's reservation is its footprint, and the loaded pair's drafter KV shape
    (from which each batch's drafter KV is booked) is the drafter's."""
    drafter_checks.node_books_the_drafter(target, NAME, drafter_dir(target), DFlashHead, DFLASH.kv_shape)


def test_grammar_rows_speculate_with_the_drafter_as_plain_decoding_together(target):
    """Two rows under JSON schemas (each block's drafts drawn position by position under the grammar's masks), a
    free row and a sampled constrained row, together: each greedy row emits its plain run's tokens and the
    constrained ones validate."""
    drafter_checks.grammar_rows_as_plain_together(target, NAME, drafter_dir(target))
