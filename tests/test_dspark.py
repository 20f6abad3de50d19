"""Speculation with a DSpark drafter (mlx-vlm's dspark / qwen3_dspark): a DFlash block drafter whose block positions'
logits are corrected by a low-rank Markov term of the token before each (issue 42), served as the dflash kind.

The fixture (fixture factory: `qwen3-dspark-tiny`) is fixtures' tiny Qwen3 target and a DSpark drafter beside it
(fixtures.dflash's layers plus markov_head.markov_w1/w2 of rank 16 and an untrained confidence head, the anchor's
position drafting the first token), distilled for seconds. Greedy output must equal plain decoding; sampled output
must be distributed as plain sampling: each draft is drawn from the logits corrected by the draft before it, and
that distribution is its q."""

import mlx.core as mx
import pytest
from mlx_lm import load

from provider.engine.dflash_drafter import DFlashDrafter
from provider.models import capability
from provider.drafters.dflash import config as dflash
from provider.drafters.dflash.head import DFlashHead, load_dflash
from tools.fixtures.dflash import drafter_dir
from tools.fixtures.mtp import train_prompts
from tests import drafter_checks, mtp_checks
from tests.drafter_checks import broken

NAME = "qwen3-dspark-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def load_head(target, model):
    return load_dflash(drafter_dir(target), model)


def test_paired_as_dflash_from_config_and_headers_listed_and_registered(target):
    drafter_checks.paired_listed_and_registered(target, NAME, drafter_dir(target), "dflash")
    flat = dflash.flat_config(capability.read_config(drafter_dir(target)))
    assert (flat["variant"], flat["markov_rank"], flat["proposal_length"], flat["sample_from_anchor"]) == \
        ("dspark", 16, 7, True)


def _inner(**change):
    return lambda c: c | {"dflash_config": c["dflash_config"] | change}


def _plain_dflash(c):
    """The same drafter labelled plain DFlash: no projector_type, no markov_rank, DFlash's architecture."""
    inner = {k: v for k, v in c["dflash_config"].items() if k not in ("projector_type", "markov_rank")}
    return c | {"architectures": ["DFlashDraftModel"], "dflash_config": inner}


W1, W2, PROJ = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"
BROKEN = {
    "missing markov_w2": ({"tensors": lambda w: {k: v for k, v in w.items() if k != W2}},
                          "has no tensor markov_head.markov_w2.weight"),
    "rank other than the tensors'": ({"config": _inner(markov_rank=8)},
                                     "markov_w1.weight is [384, 16], expected [384, 8]"),
    "misshaped markov_w2": ({"tensors": lambda w: w | {W2: w[W2][:, :8]}}, "markov_w2.weight is [384, 8]"),
    "misshaped confidence head": ({"tensors": lambda w: w | {PROJ: w[PROJ][:, :64]}}, "proj.weight is [1, 64]"),
    "confidence head missing": ({"tensors": lambda w: {k: v for k, v in w.items() if "confidence" not in k}},
                                "has no tensor confidence_head.proj"),
    "quantized markov_w1": ({"tensors": lambda w: w | {W1: mx.zeros((384, 16), dtype=mx.uint32)}}, "dtype U32"),
    "other markov head": ({"config": _inner(markov_head_type="mlp")}, "markov_head_type 'mlp'"),
    "rank zero": ({"config": _inner(markov_rank=0, projector_type="dspark")}, "markov_rank is 0"),
    "labelled plain DFlash": ({"config": _plain_dflash}, "does not load: confidence_head.proj.bias"),
    "a Gemma 4 DSpark drafter": ({"config": lambda c: c | {"architectures": ["Gemma4DSparkModel"]}},
                                 "a Gemma 4 drafter (gemma4_dspark) does not draft for qwen3 targets"),
    "sliding layers": ({"config": lambda c: c | {"layer_types": ["sliding_attention"] * 2}}, "sliding-window"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_drafter_is_refused_at_capability_time(target, tmp_path, case):
    change, why = BROKEN[case]
    drafter_checks.refused(target, broken(drafter_dir(target), tmp_path / "bad", **change), why)


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    # Refused by its config alone (a Markov head the node does not run): with the check off it would speculate.
    bad = broken(drafter_dir(target), tmp_path / "bad", config=_inner(markov_head_type="mlp"))
    drafter_checks.served_plain(target, NAME, bad)


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out, alone then 8 at once, k = 3: plain decoding's tokens, every job
    speculating, and on the distilled prompts over half the drafts accepted."""
    drafter_checks.greedy_as_plain(target, NAME, drafter_dir(target))


def test_sampled_rounds_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: mtp_checks.draws_through_the_shared_rule (the battery
    runs in test_dflash)."""
    mtp_checks.draws_through_the_shared_rule(target, load_head, drafter=DFlashDrafter)


def test_each_drafts_q_is_its_positions_distribution_given_the_draft_before_it(target):
    """Three sampled rows drafting k = 4 together in the engine's drafter: each draft's q is its row's sampler over
    the block position's logits corrected by the draft before it (the anchor for the first), recomputed here for the
    row alone, and each draft lies in it. With the drafts drawn otherwise than their q the sampled rounds are not
    exact; with the previous token held at the anchor, or no correction, the drafts are worse."""
    model, head, drafter, rows, drafts, qs = drafter_checks.sampled_rows_proposed(target, load_head, DFlashDrafter)
    k = drafts.shape[1]
    embed = model.model.embed_tokens
    for i, row in enumerate(rows):
        cache, position = row.draft["cache"], drafter._position(row)
        base = head.draft_logits(head.block(embed(mx.array([head.block_tokens(row.last, k)])), cache, position),
                                 embed.as_linear)
        previous = [row.last] + drafts[i].tolist()
        for j in range(k):
            want = row.choice.probs(head.markov_head(base[:, j], mx.array([previous[j]])))
            assert mx.allclose(qs[i][j], want, atol=1e-5).item(), (i, j)
            assert want[0, previous[j + 1]].item() > 0


@pytest.mark.parametrize("from_anchor", [True, False])
def test_the_drafter_drafts_as_mlx_vlms_dspark_drafter(target, from_anchor):
    """mlx-vlm's DSparkDraftModel on the same weights and tapped layers: at every block position the same corrected
    logits (within 1e-5) given the same previous draft, and the same greedy drafts, for a prompt's block and a
    second block after three more committed positions; with the anchor drafting the first token or not."""
    model, _ = load(str(target))
    ours = load_head(target, model)
    ours.from_anchor = int(from_anchor)
    theirs = drafter_checks.mlx_vlm_drafter(drafter_dir(target), model, "dspark",
                                            _inner(sample_from_anchor=from_anchor))
    embed, k = model.model.embed_tokens, 4
    ids = mx.array([train_prompts()[1] + list(range(40, 60))])
    model(ids)
    mine, their_cache, position = ours.make_cache(), theirs.make_cache(), 0
    for features, bonus in ((ours.tap.last, 77), (None, 11)):
        if features is None:
            model(mx.array([[77, 5, 9]]))  # no cache: three fresh positions' features stand in for a verify's
            features = ours.tap.last
        ours.context(features, mine, position)
        position += features.shape[1]
        seen = []

        def argmax(logits):  # mlx-vlm's sampler: called on each position's corrected logits in turn
            seen.append(logits)
            return mx.argmax(logits, -1)

        their_drafts = theirs.draft_block(bonus, features, their_cache, k + 1, argmax)
        base = ours.draft_logits(ours.block(embed(mx.array([ours.block_tokens(bonus, k)])), mine, position),
                                 embed.as_linear)
        previous, drafts = mx.array([bonus]), []
        for j in range(k):
            corrected = ours.markov_head(base[:, j], previous)
            assert mx.allclose(corrected, seen[j], atol=1e-5).item(), j
            previous = mx.argmax(corrected, -1)
            drafts.append(previous.item())
        assert drafts == their_drafts[0].tolist()
        assert not mx.allclose(base[:, 1], seen[1], atol=1e-3).item()  # the correction is not nil


def test_the_books_are_what_loads(target, tmp_path):
    """Booked: the drafter's weights as it holds them loaded, the Markov tensors among them and the ignored
    confidence head not, and its activations."""
    drafter = drafter_dir(target)
    _, head, _ = drafter_checks.weights_and_activations_booked(target, drafter, load_head, dflash, DFlashHead)
    markov = 2 * 384 * 16 * 4  # w1 and w2, vocabulary x rank, float32
    assert sum(p.nbytes for p in (head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight)) == markov
    no_markov = broken(drafter, tmp_path / "no-markov",
                       tensors=lambda w: {k: v for k, v in w.items() if "markov" not in k})
    assert dflash.weight_bytes(drafter) - dflash.weight_bytes(no_markov) == markov
    assert not hasattr(head, "confidence_head")


def test_grammar_rows_speculate_with_the_drafter_as_plain_decoding_together(target):
    """Two rows under JSON schemas (each draft drawn under the grammar's mask, the next position corrected by that
    draft), a free row and a sampled constrained row, together: greedy rows emit their plain tokens, the constrained
    ones validate."""
    drafter_checks.grammar_rows_as_plain_together(target, NAME, drafter_dir(target))
