"""Speculation with a Laguna DFlash drafter (mlx-vlm's laguna_dflash: a DFlash drafter with a causal block, a sliding
window, a fused q/k/v projection, per-head softplus gates and a norm per tapped layer) on a Laguna target, through the
real engine (issue 42).

The fixture (`laguna-dflash-tiny`) is a tiny Laguna (mlx-lm's laguna: gated attention, three sliding layers of window 16
and a full one, a dense MLP then MoE layers) with a 2-layer drafter of window 24 on its layers 1 and 2, distilled for
seconds. The rest of DFlash is tests/test_dflash.py's."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from provider.engine.dflash_drafter import DFlashDrafter
from provider.jobs import SamplingParams
from provider.models import capability
from provider.drafters.dflash import config as dflash
from provider.drafters.dflash.head import WindowedContext, load_dflash, target_embedding
from tools.fixtures.dflash import drafter_dir
from tools.fixtures.mtp import train_prompts
from provider.drafters.dflash.kind import KIND as DFLASH
from provider.drafters.dflash.laguna_head import LagunaHead
from tests import drafter_checks, mtp_checks
from tests.drafter_checks import broken

NAME = "laguna-dflash-tiny"
WINDOW = 24


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def load_head(target, model):
    return load_dflash(drafter_dir(target), model, LagunaHead)


def test_paired_as_dflash_listed_and_registered(target):
    drafter_checks.paired_listed_and_registered(target, NAME, drafter_dir(target), "dflash")
    flat = dflash.flat_config(capability.read_config(drafter_dir(target)))
    assert (flat["variant"], flat["context_window"], flat["causal_block"], flat["rope_theta"]) == \
        ("laguna", WINDOW - 1, True, 1000000.0)


def _inner(**change):
    return lambda c: c | {"dflash_config": c["dflash_config"] | change}


QKV = "model.layers.0.self_attn.qkv_proj.weight"
BROKEN = {
    "gating a bool": ({"config": lambda c: c | {"gating": True}}, "gating True is not served"),
    "blocks not causal": ({"config": _inner(causal=False)}, "blocks are causal"),
    "windows that differ": ({"config": lambda c: c | {"sliding_windows": [WINDOW, 16]}}, "layers of one window"),
    "full-attention layers": ({"config": lambda c: c | {"layer_types": ["full_attention"] * 2}},
                              "layers of one window"),
    "fewer tapped layers than layers": ({"config": _inner(target_layer_ids=[1])}, "one target layer per layer"),
    "a draft vocabulary": ({"config": lambda c: c | {"draft_vocab_size": 100}}, "draft vocabulary"),
    "qkv biases": ({"config": lambda c: c | {"qkv_bias": True}}, "qkv biases"),
    "no RoPE theta": ({"config": lambda c: {k: v for k, v in c.items() if k != "rope_theta"}}, "rope_theta is None"),
    "a RoPE type mlx-lm has not": ({"config": lambda c: c | {"rope_parameters": {"rope_type": "ntk"}}},
                                   "Unsupported RoPE type ntk"),
    "linear RoPE without its factor": ({"config": lambda c: c | {"rope_parameters": {"rope_type": "linear"}}},
                                       "malformed DFlash RoPE scaling"),
    "misshaped qkv": ({"tensors": lambda w: w | {QKV: w[QKV][:-16]}}, "has no tensor layers.0.self_attn.q_proj"),
    "no gate": ({"tensors": lambda w: {k: v for k, v in w.items() if "layers.1.self_attn.g_proj" not in k}},
                "has no tensor layers.1.self_attn.g_proj.weight"),
    "no norm for a tapped layer": ({"tensors": lambda w: {k: v for k, v in w.items() if "aux_hidden_norms.1" not in k}},
                                   "has no tensor aux_hidden_norms.1.weight"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_drafter_is_refused(target, tmp_path, case):
    change, why = BROKEN[case]
    drafter_checks.refused(target, broken(drafter_dir(target), tmp_path / "bad", **change), why)


def test_it_drafts_for_laguna_targets_only(target):
    config = capability.read_config(drafter_dir(target))
    qwen3 = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 384, "num_hidden_layers": 4}
    assert "does not draft for qwen3 targets" in dflash.check_pair(qwen3, drafter_dir(target), config)


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    bad = broken(drafter_dir(target), tmp_path / "bad", config=_inner(causal=False))
    drafter_checks.served_plain(target, NAME, bad)


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out of 1 to 90 tokens (past both windows), alone then 8 at once, k = 3:
    plain decoding's tokens, every job speculating, over half the distilled prompts' drafts accepted."""
    drafter_checks.greedy_as_plain(target, NAME, drafter_dir(target))


def test_sampled_rounds_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_dflash)."""
    params = SamplingParams(max_tokens=6, temperature=0.05, top_p=0.95, top_k=32, seed=3)
    mtp_checks.draws_through_the_shared_rule(target, load_head, train_prompts()[0], params, drafter=DFlashDrafter)


def _theirs(target, model):
    """mlx-vlm's LagunaDFlashDraftModel on the checkpoint, bound as its bind binds (the target's embedding and LM
    head), without its check, which asks mlx-vlm's own Laguna class for its cache rollback."""
    from mlx_vlm.speculative.drafters import laguna_dflash as family

    theirs = family.Model(family.ModelConfig.from_dict(json.loads((drafter_dir(target) / "config.json").read_text())))
    weights = dict(mx.load(str(drafter_dir(target) / "model.safetensors")))
    theirs.load_weights(list(theirs.sanitize(weights).items()), strict=True)
    theirs.embed_tokens, theirs.lm_head, theirs.embed_scale = model.model.embed_tokens, model.lm_head, 1.0
    return theirs


def test_the_drafter_drafts_as_mlx_vlms_within_its_window(target):
    """mlx-vlm's drafter on the same weights: the same block logits within 1e-5 for a 12-token prompt and after 3 more
    positions (contexts the window does not cut). Past it (a 60-token context), the first layer's output at each
    block position j is mlx-vlm's layer's given exactly the W - 1 - j positions before the block (RoPE is relative),
    within 1e-5: a query sees the W - 1 positions before it, as the target's own sliding layers do (mlx-vlm lets
    every block position see all W - 1). The node's cache holds the last W - 1. Without the window's per-query cut,
    it fails (seen)."""
    model, _ = load(str(target))
    ours, theirs = load_head(target, model), _theirs(target, model)
    embed, lm_head = target_embedding(model)
    k, cache, their_cache = 4, ours.make_cache(), theirs.make_cache()
    block = embed(mx.array([[77] + [ours.mask_token_id] * k]))
    for chunk in (list(range(3, 15)), [77, 5, 9]):
        model(mx.array([chunk]))
        ours.context(ours.tap.last, cache, cache[0].offset)
        b = theirs.draft_block(77, ours.tap.last, their_cache, k + 1, lambda x: x)
        a = ours.logits(ours.block(block, cache, cache[0].offset)[:, 1:], lm_head)
        assert mx.allclose(a, b, atol=1e-5).item()
    model(mx.array([list(range(3, 63))]))
    features, cache = ours.tap.last, ours.make_cache()
    ours.context(features, cache, 0)
    assert all(isinstance(c, WindowedContext) and c.keys.shape[2] == WINDOW - 1 for c in cache)
    mine = ours.layers[0](block, ours._held(cache[0]), 60, ours._mask([WINDOW - 1], k + 1))
    context = theirs._combine_hidden(features)
    for j in range(k + 1):
        layer = theirs.layers[0](block, context[:, -(WINDOW - 1 - j):], theirs.rope, theirs.make_cache()[0])
        assert mx.allclose(mine[:, j], layer[:, j], atol=1e-5).item(), (j, mx.abs(mine[:, j] - layer[:, j]).max())


def test_a_checkpoint_with_q_k_v_apart_loads_the_same(target, tmp_path):
    """Split q/k/v_proj (mlx-vlm's sanitize fuses them) pair and load to the same drafter as the fused qkv_proj."""
    def split(w):
        out = {k: v for k, v in w.items() if "qkv_proj" not in k}
        for name in (k for k in w if "qkv_proj" in k):
            q, kk, v = mx.split(w[name], [64, 96])
            out |= {name.replace("qkv", p): t for p, t in zip("qkv", (q, kk, v))}
        return out

    apart = broken(drafter_dir(target), tmp_path / "apart", tensors=split)
    assert drafter_checks.caps_with(target, apart).drafter_reason == "ok"
    model, _ = load(str(target))
    fused, separate = load_head(target, model), load_dflash(apart, model, LagunaHead)
    for (name, a), (_, b) in zip(sorted(tree_flatten(fused.parameters())), sorted(tree_flatten(separate.parameters()))):
        assert mx.array_equal(a, b).item(), name


def test_the_books_are_what_loads(target):
    """The drafter's weights as loaded and its activations; its context K/V booked as a sliding-window layer's (2
    layers, K and V, 2 KV heads of 16, float32, the W - 1 = 23 positions its cache holds); through the node too."""
    drafter = drafter_dir(target)
    _, head, config = drafter_checks.weights_and_activations_booked(target, drafter, load_head, dflash, LagunaHead)
    shape = DFLASH.kv_shape(drafter, config)
    assert (shape.bytes_per_token_full, shape.bytes_per_token_sliding, shape.sliding_window) == \
        (0, 2 * 2 * 2 * 16 * 4, WINDOW - 1)
    drafter_checks.node_books_the_drafter(target, NAME, drafter, LagunaHead, DFLASH.kv_shape)


def test_grammar_rows_speculate_with_the_drafter_as_plain_decoding_together(target):
    drafter_checks.grammar_rows_as_plain_together(target, NAME, drafter_dir(target))
