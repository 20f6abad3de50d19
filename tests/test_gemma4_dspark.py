"""Speculation with a Gemma 4 DSpark drafter (mlx-vlm's gemma4_dspark: DSpark's block and Markov correction with
Gemma 4's layers, its own embedding and LM head) on a Gemma 4 target, through the real engine (issue 42).

The fixture (`gemma4-dspark-tiny`) is fixtures' tiny Gemma 4 with the drafter on its layers 2 (full) and 4
(KV-shared sliding), distilled for seconds. What is this drafter's own: Gemma 4's attention (global_head_dim, keys
as values, a unit scale, proportional RoPE), sandwich norms, GeGLU and layer scalars, the block embedded and read
by the drafter's own tables, and the layout mlx-vlm reads (architecture tag, flat DSpark keys, `model.` names). The
rest of DSpark is tests/test_dspark.py's."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from provider.engine.dflash_drafter import DFlashDrafter
from provider.jobs import SamplingParams
from provider.models import capability
from provider.drafters.dflash import config as dflash
from provider.drafters.dflash.head import load_dflash
from tools.fixtures.dflash import drafter_dir
from tools.fixtures.mtp import train_prompts
from provider.drafters.dflash.kind import KIND as DFLASH
from provider.drafters.dflash.gemma4_dspark_head import Gemma4DSparkHead
from tests import drafter_checks, mtp_checks
from tests.drafter_checks import broken

NAME = "gemma4-dspark-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def load_head(target, model):
    return load_dflash(drafter_dir(target), model, Gemma4DSparkHead)


def test_paired_as_dflash_listed_and_registered(target):
    drafter_checks.paired_listed_and_registered(target, NAME, drafter_dir(target), "dflash")
    flat = dflash.flat_config(capability.read_config(drafter_dir(target)))
    assert (flat["variant"], flat["head_dim"], flat["num_key_value_heads"], flat["proposal_length"],
            flat["rope_theta"], flat["rope_scaling"]["partial_rotary_factor"]) == \
        ("gemma4_dspark", 32, 1, 7, 1_000_000.0, 0.25)


K0, V0 = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"


def _with_values(c):
    return c | {"attention_k_eq_v": False}


def _rope(**full):
    return lambda c: c | {"rope_parameters": c["rope_parameters"] | {"full_attention": full}}


BROKEN = {
    "no LM head of its own": ({"tensors": lambda w: {k: v for k, v in w.items() if "lm_head" not in k}},
                              "has no tensor lm_head.weight"),
    "values apart but no v_proj": ({"config": _with_values}, "has no tensor layers.0.self_attn.v_proj.weight"),
    "a v_proj beside keys as values": ({"tensors": lambda w: w | {V0: w[K0]}}, "does not load: layers.0.self_attn.v"),
    "global head dim other than the tensors'": ({"config": lambda c: c | {"global_head_dim": 16}},
                                                "q_proj.weight is [128, 64], expected [64, 64]"),
    "no layer scalar": ({"tensors": lambda w: {k: v for k, v in w.items() if "layers.1.layer_scalar" not in k}},
                        "has no tensor layers.1.layer_scalar"),
    "yarn RoPE": ({"config": _rope(rope_type="yarn", rope_theta=1e6)}, "RoPE type 'yarn'"),
    "RoPE not a table": ({"config": lambda c: c | {"rope_parameters": {"full_attention": 5}}}, "not a table"),
    "silu MLP": ({"config": lambda c: c | {"hidden_activation": "silu"}}, "hidden_activation 'silu'"),
    "MoE layers": ({"config": lambda c: c | {"enable_moe_block": True}}, "MoE"),
    "sliding layers": ({"config": lambda c: c | {"layer_types": ["sliding_attention"] * 2}}, "sliding-window"),
    "softcap a string": ({"config": lambda c: c | {"final_logit_softcapping": "30"}}, "final_logit_softcapping"),
    "rank other than the tensors'": ({"config": lambda c: c | {"markov_rank": 8}}, "expected [512, 8]"),
    "drafts nothing": ({"config": lambda c: c | {"block_size": 0}}, "malformed DFlash config: block_size is 0"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_drafter_is_refused(target, tmp_path, case):
    change, why = BROKEN[case]
    drafter_checks.refused(target, broken(drafter_dir(target), tmp_path / "bad", **change), why)


def test_it_drafts_for_gemma_4_targets_only(target):
    config = capability.read_config(drafter_dir(target))
    qwen3 = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 512, "num_hidden_layers": 6}
    assert "does not draft for qwen3 targets" in dflash.check_pair(qwen3, drafter_dir(target), config)


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    drafter_checks.served_plain(target, NAME, broken(drafter_dir(target), tmp_path / "bad", config=_with_values))


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out of 1 to 90 tokens (past the target's 32-token window), alone then
    8 at once, k = 3: plain decoding's tokens. Alone, over half the distilled prompts' drafts are accepted (together
    their prefixes come from the prefix cache and the drafter's context skips them, as test_gemma4_dflash's)."""
    drafter_checks.greedy_as_plain_accepted_alone(target, NAME, drafter_dir(target))


def test_sampled_rounds_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_dflash)."""
    params = SamplingParams(max_tokens=6, temperature=0.05, top_p=0.95, top_k=32, seed=3)
    mtp_checks.draws_through_the_shared_rule(target, load_head, train_prompts()[0], params, drafter=DFlashDrafter)


@pytest.mark.parametrize("keys_as_values", [True, False])
def test_the_drafter_drafts_as_mlx_vlms_gemma4_dspark_drafter(target, tmp_path, keys_as_values):
    """mlx-vlm's Gemma4DSparkDraftModel on the same weights (its own embedding and LM head kept) and tapped layers:
    the same corrected logits at every block position given the same previous draft, and the same greedy drafts;
    with keys as values (mlx-vlm 0.7.10's fused context projection reads a v_proj such a layer has not and fails:
    its per-layer path is taken) and with a v_proj of its own."""
    drafter = drafter_dir(target)
    if not keys_as_values:
        drafter = broken(drafter, tmp_path / "kv", config=_with_values,
                         tensors=lambda w: w | {k.replace("k_proj", "v_proj"): 0.5 * v for k, v in w.items()
                                                if "k_proj" in k})
    model, _ = load(str(target))
    ours = load_dflash(drafter, model, Gemma4DSparkHead)
    theirs = drafter_checks.mlx_vlm_drafter(drafter, model, "gemma4_dspark")
    if keys_as_values:
        theirs._project_context_kv = lambda ctx: None
    theirs.embed_tokens, theirs.lm_head = ours.embed_tokens, ours.lm_head  # DFlashDraftModel.bind took the target's
    ids = mx.array([train_prompts()[1] + list(range(40, 80))])  # past the window
    model(ids)
    features, (embed, lm_head), k = ours.tap.last, ours.embedding(model), 4
    cache = ours.make_cache()
    ours.context(features, cache, 0)
    base = ours.draft_logits(ours.block(embed(mx.array([ours.block_tokens(77, k)])), cache, ids.shape[1]), lm_head)
    seen = []

    def argmax(logits):
        seen.append(logits)
        return mx.argmax(logits, -1)

    their_drafts = theirs.draft_block(77, features, theirs.make_cache(), k + 1, argmax)
    previous, drafts = mx.array([77]), []
    for j in range(k):
        corrected = ours.markov_head(base[:, j], previous)
        assert mx.allclose(corrected, seen[j], atol=1e-4).item(), j
        previous = mx.argmax(corrected, -1)
        drafts.append(previous.item())
    assert drafts == their_drafts[0].tolist() and mx.abs(base).max().item() <= 30.0


def test_the_books_are_what_loads(target):
    """The drafter's weights as loaded (its embedding and LM head among them), its activations, its context KV per
    token (2 layers, K and V, one KV head of global_head_dim 32, float32), and through the node."""
    drafter = drafter_dir(target)
    _, head, _ = drafter_checks.weights_and_activations_booked(target, drafter, load_head, dflash, Gemma4DSparkHead)
    assert head.embed_tokens.weight.nbytes == head.lm_head.weight.nbytes == 512 * 64 * 4
    assert DFLASH.kv_shape(drafter, json.loads((drafter / "config.json").read_text())).bytes_per_token_full == \
        2 * 2 * 1 * 32 * 4
    drafter_checks.node_books_the_drafter(target, NAME, drafter, Gemma4DSparkHead, DFLASH.kv_shape)


def test_grammar_rows_speculate_with_the_drafter_as_plain_decoding_together(target):
    drafter_checks.grammar_rows_as_plain_together(target, NAME, drafter_dir(target))
