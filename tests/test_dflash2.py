"""Speculation with a DFlash2 drafter (mlx-vlm's dflash2): DFlash layers wrapped in grouped dynamic causal
convolutions over the block's positions, and a candidate selector that picks each draft among the base logits' top-k
by its logit plus an edge of the token before it (issue 42), served as the dflash kind.

The fixture (fixture factory: `qwen3-dflash2-tiny`) is fixtures' tiny Qwen3 target and a DFlash2 drafter beside it
(fixtures.dflash's layers plus convolutions of kernel 3, a selector of rank 16 over the top 32, an input scale, output
multiplier and softcap), distilled for seconds. Greedy output must equal plain decoding; sampled output must be
distributed as plain sampling: each draft is drawn through the shared accept rule's draw from the softmax of its
candidates' scores given the draft before it, and that distribution is its q (the distribution battery runs once per
engine drafter class: DFlashDrafter's in test_dflash)."""

import mlx.core as mx
import pytest
from mlx_lm import load

from provider.engine.dflash_drafter import DFlashDrafter
from provider.models import capability
from provider.drafters.dflash import config as dflash
from provider.drafters.dflash.dflash2_head import DFlash2Head, load_dflash2
from tools.fixtures.dflash import drafter_dir
from tools.fixtures.mtp import train_prompts
from provider.drafters.dflash.kind import KIND as DFLASH
from tests import drafter_checks, mtp_checks
from tests.drafter_checks import broken

NAME = "qwen3-dflash2-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def load_head(target, model):
    return load_dflash2(drafter_dir(target), model)


def test_paired_as_dflash_from_config_and_headers_listed_and_registered(target):
    drafter_checks.paired_listed_and_registered(target, NAME, drafter_dir(target), "dflash")
    flat = dflash.flat_config(capability.read_config(drafter_dir(target)))
    assert (flat["variant"], flat["selector_top_k"], flat["conv_kernel_size"], flat["output_multiplier"]) == \
        ("dflash2", 32, 3, 0.75)


def _inner(**change):
    return lambda c: c | {"dflash_config": c["dflash_config"] | change}


PRED, PROJ = "candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight"
KERNEL = "layers.1.mlp_conv.kernel_projection.weight"
BROKEN = {
    "missing hidden projection": ({"tensors": lambda w: {k: v for k, v in w.items() if k != PROJ}},
                                  "has no tensor candidate_selector.hidden_projection.weight"),
    "rank other than the tensors'": ({"config": _inner(selector_rank=8)},
                                     "predecessor_codebook.weight is [384, 16], expected [384, 8]"),
    "kernel other than the tensors'": ({"config": _inner(conv_kernel_size=4)},
                                       "base_kernel is [2, 3, 64], expected [2, 4, 64]"),
    "misshaped kernel projection": ({"tensors": lambda w: w | {KERNEL: w[KERNEL][:12]}},
                                    "kernel_projection.weight is [12, 64]"),
    "group size not dividing": ({"config": _inner(conv_group_size=24)}, "does not divide hidden_size 64"),
    "top-k beyond the vocabulary": ({"config": _inner(selector_top_k=385)}, "exceeds the vocabulary"),
    "quantized codebook": ({"tensors": lambda w: w | {PRED: mx.zeros((384, 16), dtype=mx.uint32)}}, "dtype U32"),
    "no selector in the config": ({"config": lambda c: c | {"dflash_config": {
        k: v for k, v in c["dflash_config"].items() if k != "selector_top_k"}}}, "selector_top_k is 0"),
    "labelled plain DFlash": ({"config": lambda c: c | {"architectures": ["DFlashDraftModel"]}},
                              "does not load: candidate_selector"),
    "gelu": ({"config": lambda c: c | {"hidden_act": "gelu"}}, "hidden_act 'gelu'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_drafter_is_refused_at_capability_time(target, tmp_path, case):
    change, why = BROKEN[case]
    drafter_checks.refused(target, broken(drafter_dir(target), tmp_path / "bad", **change), why)


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    # Refused by its config alone (a top-k beyond the vocabulary): with the check off it would load and speculate.
    drafter_checks.served_plain(target, NAME, broken(drafter_dir(target), tmp_path / "bad",
                                                     config=_inner(selector_top_k=385)))


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out, alone then 8 at once, k = 3: plain decoding's tokens, every job
    speculating, and on the distilled prompts over half the drafts accepted."""
    drafter_checks.greedy_as_plain(target, NAME, drafter_dir(target))


def test_sampled_rounds_draw_through_the_shared_rule(target):
    """Sampled rounds are distributed as plain sampling: each draft is what the shared rule drew from the q it reports
    (mtp_checks.draws_through_the_shared_rule; the battery for DFlashDrafter runs in test_dflash), and that q is the
    selector's distribution given the draft before it (the next test)."""
    mtp_checks.draws_through_the_shared_rule(target, load_head, drafter=DFlashDrafter)


def test_each_drafts_q_is_the_selectors_distribution_given_the_draft_before_it(target):
    """Three sampled rows drafting k = 4 together in the engine's drafter: each draft's q is its row's sampler over
    the softmax of the block position's candidates' scores given the draft before it (the anchor for the first),
    recomputed here for the row alone: zero outside the top 32 of the base logits, and the draft one of them. With q
    taken from the base logits (the draw the selector's), or the previous token held at the anchor, this fails."""
    model, head, drafter, rows, drafts, qs = drafter_checks.sampled_rows_proposed(target, load_head, DFlashDrafter)
    embed, k = model.model.embed_tokens, drafts.shape[1]
    for i, row in enumerate(rows):
        hidden = head.block(embed(mx.array([head.block_tokens(row.last, k)])), row.draft["cache"],
                            drafter._position(row))
        base = head.draft_logits(hidden, embed.as_linear)
        previous = [row.last] + drafts[i].tolist()
        for j in range(k):
            scattered = head.candidate_selector.proposal(base[:, j], hidden[:, 1 + j], mx.array([previous[j]]))
            want = row.choice.probs(scattered)
            assert mx.allclose(qs[i][j], want, atol=1e-5).item(), (i, j)
            assert (want > 0).sum().item() <= 32 and want[0, previous[j + 1]].item() > 0, (i, j)


def test_the_drafter_drafts_as_mlx_vlms_dflash2_drafter(target):
    """mlx-vlm's DFlash2DraftModel on the same weights and tapped layers: the same block logits (within 1e-5), the
    same candidates' scores at every position given the same previous draft, and the same greedy drafts, for a
    prompt's block and a second block after three more committed positions."""
    model, _ = load(str(target))
    ours = load_head(target, model)
    theirs = drafter_checks.mlx_vlm_drafter(drafter_dir(target), model, "dflash2")
    embed, k, seen = model.model.embed_tokens, 4, {}
    select = theirs.candidate_selector.select

    def spy(hidden, logits, anchor, sampler):  # their block's logits, and each position's scores as sampled
        seen.update(logits=logits, scores=[])

        class Argmax:
            def sample_proposal(self, scores):
                seen["scores"].append(scores)
                return mx.argmax(scores, -1)

        return select(hidden, logits, anchor, Argmax())

    theirs.candidate_selector.select = spy
    model(mx.array([train_prompts()[1] + list(range(40, 60))]))
    mine, their_cache, position = ours.make_cache(), theirs.make_cache(), 0
    for features, bonus in ((ours.tap.last, 77), (None, 11)):
        if features is None:
            model(mx.array([[77, 5, 9]]))  # no cache: three fresh positions' features stand in for a verify's
            features = ours.tap.last
        ours.context(features, mine, position)
        position += features.shape[1]
        their_drafts = theirs.draft_block(bonus, features, their_cache, k + 1, None)
        hidden = ours.block(embed(mx.array([ours.block_tokens(bonus, k)])), mine, position)
        base = ours.draft_logits(hidden, embed.as_linear)
        assert mx.allclose(base, seen["logits"], atol=1e-5).item()
        previous, drafts = mx.array([bonus]), []
        for j in range(k):
            _, scores = ours.candidate_selector.scores(base[:, j], hidden[:, 1 + j], previous)
            assert mx.allclose(mx.sort(scores), mx.sort(seen["scores"][j]), atol=1e-5).item(), j
            previous = mx.argmax(ours.candidate_selector.proposal(base[:, j], hidden[:, 1 + j], previous), -1)
            drafts.append(previous.item())
        assert drafts == their_drafts[0].tolist()
        unary = mx.sort(mx.topk(base[:, 1], 32, axis=-1))
        assert not mx.allclose(unary, mx.sort(seen["scores"][1]), atol=1e-3).item()  # the edges are not nil


def test_the_books_are_what_loads(target, tmp_path):
    """Booked: the drafter's weights as it holds them loaded, the selector's and the convolutions' among them, its
    activations, and through the node its reservation and its context KV (the dflash2 loader's row)."""
    drafter = drafter_dir(target)
    _, head, _ = drafter_checks.weights_and_activations_booked(target, drafter, load_head, dflash, DFlash2Head)
    selector = (2 * 384 * 16 + 16 * 64) * 4  # two codebooks (vocabulary x rank) and the hidden projection, float32
    convs = 2 * 2 * (2 * 3 * 64 + 2 * 3 * 4 * 64) * 4  # 2 layers x 2 convolutions: base kernel, kernel projection
    assert sum(p.nbytes for p in (head.candidate_selector.predecessor_codebook.weight,
                                  head.candidate_selector.successor_codebook.weight,
                                  head.candidate_selector.hidden_projection.weight)) == selector
    plain = broken(drafter, tmp_path / "plain",
                   tensors=lambda w: {k: v for k, v in w.items() if "selector" not in k and "_conv" not in k})
    assert dflash.weight_bytes(drafter) - dflash.weight_bytes(plain) == selector + convs
    drafter_checks.node_books_the_drafter(target, NAME, drafter, DFlash2Head, DFLASH.kv_shape)


def test_grammar_rows_speculate_with_the_drafter_as_plain_decoding_together(target):
    """Two rows under JSON schemas (each draft's candidates the best allowed tokens), a free row and a sampled
    constrained row, together: greedy rows emit their plain tokens, the constrained ones validate."""
    drafter_checks.grammar_rows_as_plain_together(target, NAME, drafter_dir(target))
