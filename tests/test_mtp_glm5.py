"""Speculation with GLM-5's nextn (MTP) layer shipped inside its checkpoint (issue 42), through the real engine.

The fixture is a tiny glm_moe_dsa (MLA whose scores DeepSeek sparse attention's indexer restricts to its top 8
positions, MoE with a shared expert) in the published layout, its nextn layer as `model.layers.<num_hidden_layers>.*`
with no embedding or LM head of its own, distilled briefly on its target. Prompts past 8 tokens take the sparse path
in the target and in the head. Greedy output must equal plain decoding; sampled output must be distributed as plain
sampling; the head must compute what mlx-vlm's glm_moe_dsa_mtp drafter computes on the same weights."""

import json

import pytest
from mlx.utils import tree_flatten

from provider.jobs import SamplingParams
from tools.fixtures.mtp import train_prompts
from provider.drafters.mtp.glm4_moe_lite import load_head
from tests import mtp_checks

NAME = "glm_moe_dsa-mtp-tiny"
NEXTN = "model.layers.3."  # num_hidden_layers = 3


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def test_capability_and_books_from_config_and_the_nextn_tensors(target, tmp_path):
    config = mtp_checks.found_but_not_when_stripped(target, tmp_path / "stripped", lambda k: k.startswith(NEXTN))
    assert "index_topk" in config and config["num_nextn_predict_layers"] == 1
    # Booked once, as the drafter: the nextn layer's tensors (no embedding or LM head of its own) + activations.
    # Per token, the latent (kv_lora_rank 32), the rotated k_pe (8) and the indexer's key (16) with the zeros mlx-lm
    # stores as its values (16), float32: what the head's cache holds after 5 pairs, byte for byte. The target's
    # embedding and LM head.
    mtp_checks.books_as_held(target, config, load_head, (32 + 8 + 2 * 16) * 4, own_parts=False)


@pytest.mark.parametrize("broken", ["eh_proj cut", "indexer gone", "own embedding without its head"])
def test_a_malformed_head_is_refused_at_load_and_the_target_still_served(target, tmp_path, broken):
    """The header still says a head is there (capability holds); the load refuses it cleanly, and the node decodes
    plain with the reason (auto), its output plain decoding's."""
    change = {
        "eh_proj cut": lambda w: w | {NEXTN + "eh_proj.weight": w[NEXTN + "eh_proj.weight"][:, :127]},
        "indexer gone": lambda w: {k: v for k, v in w.items() if not k.startswith(NEXTN + "self_attn.indexer.wk")},
        "own embedding without its head": lambda w: w | {NEXTN + "embed_tokens.weight": w["model.embed_tokens.weight"]},
    }[broken]
    mtp_checks.refused_and_served_plain(mtp_checks.rewritten(target, tmp_path / "bad", change), target, NAME, load_head)


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    """Prompts of 1 to 90 tokens (two past index_topk), alone then 8 together: plain decoding's tokens, and on the
    prompts the head was distilled on, most drafts accepted."""
    ps, alone, _ = mtp_checks.greedy_as_plain(target, NAME)
    assert sum(len(p) > json.loads((target / "config.json").read_text())["index_topk"] for p in ps) == 2
    spec = [done.telemetry.speculation for _, _, done, _ in alone[:4]]
    assert sum(s.accepted for s in spec) > 0.4 * sum(s.judged for s in spec), spec


def _their_name(name: str) -> str:
    name = "shared_head_norm.weight" if name == "shared_head.norm.weight" else name.removeprefix("block.")
    return "mtp." + name


def test_the_head_computes_what_mlx_vlms_glm_moe_dsa_drafter_computes_on_the_same_weights(target):
    """mlx-vlm's own drafter (load_drafter: its split of the checkpoint, its GlmMoeDsaMTP) against the head as loaded
    here: the same parameters bit for bit (the router's correction bias float32 on both); on a prompt of 30 pairs
    (sparse: index_topk 8) then four draft steps, the same seed hidden, draft tokens, and cached latents, positional
    keys and indexer keys; and the node's own drafting (HeadDrafter in the round loop, prompt read in chunks of 8)
    proposes mlx-vlm's drafts."""
    pytest.importorskip("mlx_vlm.speculative.drafters.glm_moe_dsa_mtp")
    from mlx_vlm.speculative.drafters import load_drafter

    from provider.engine.proposers import HeadDrafter
    from provider.engine.spec_rounds import Speculator
    from provider.models.gemma4_target import Target
    from provider.telemetry import SpecTelemetry

    theirs, _ = load_drafter(str(target), kind="mtp")
    assert type(theirs).__name__ == "GlmMoeDsaMTPDraftModel"
    model, tap, ours = mtp_checks.loaded(target, load_head)
    mtp_checks.same_parameters({_their_name(k): v for k, v in tree_flatten(ours.parameters())},
                               dict(tree_flatten(theirs.parameters())))
    ids, cache = mtp_checks.drafts_as_mlx_vlms(target, model, tap, ours, theirs, model.model.embed_tokens,
                                               model.lm_head)
    assert ids.shape[1] > 8 and cache[0][1].offset == ids.shape[1] + 3  # the indexer's keys: every pair

    spec = Speculator(model, HeadDrafter(ours, Target(model)))
    row = spec.new_row(ids[0].tolist(), stats=SpecTelemetry("mtp", k=4))
    while not spec.read(row, 8):
        pass
    first = spec.begin([row])[0]
    drafts, _ = spec.drafter.propose([row], 4, row.caches)
    theirs.reset(model)
    model(ids)
    theirs.prefill_from_target_hidden(ids, tap.last, first, None, greedy=True)
    assert drafts.tolist() == theirs.draft_block(first, None, None, 5, None, greedy=True).tolist()


def test_sampled_rounds_with_the_head_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_mtp_families)."""
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, top_k=32, seed=3)
    mtp_checks.draws_through_the_shared_rule(target, load_head, train_prompts()[0], params)

