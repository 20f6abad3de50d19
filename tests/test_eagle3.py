"""Speculation with an EAGLE-3 drafter: a checkpoint of its own, trained against its target, reading three of the
target's decoder layers (issue 42), through the real engine.

The fixture (fixture factory: `llama-eagle3-tiny`) is fixtures' tiny Llama target and a drafter in the published
layout beside it (fc, midlayer.*, norm, lm_head over a 256-id draft vocabulary, d2t, t2d), distilled for seconds on
the target's greedy continuations of the training prompts: drafts on those are accepted often, on other text seldom.
Greedy output must equal plain decoding; sampled output must be distributed as plain sampling."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from provider.engine.proposers import Eagle3Drafter
from provider.models import capability
from provider.drafters.eagle3 import config as eagle3
from provider.drafters.eagle3.head import Eagle3Head, load_eagle3
from tools.fixtures.eagle3 import drafter_dir
from tools.fixtures.mtp import train_prompts
from provider.drafters.eagle3.kind import KIND as EAGLE3
from provider.proofs.hidden_tap import install_layers
from tests import drafter_checks
from tests.drafter_checks import broken, caps_with

NAME = "llama-eagle3-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def load_head(target, model):
    return load_eagle3(drafter_dir(target), model)


def test_paired_as_eagle3_from_config_and_headers_listed_and_registered(target):
    drafter_checks.paired_listed_and_registered(target, NAME, drafter_dir(target), "eagle3")
    # The three captured layers' inputs: the outputs of target layers 0, 1 and 2 (of 4).
    flat = eagle3.flat_config(capability.read_config(drafter_dir(target)))
    assert eagle3.tapped_layers(flat, 4) == [0, 1, 2]


def _d2t_shifted(w, at, by):
    d2t = np.array(w["d2t"])
    d2t[at] += by
    return w | {"d2t": mx.array(d2t)}


BROKEN = {
    "missing q_proj": ({"tensors": lambda w: {k: v for k, v in w.items() if "q_proj" not in k}}, "has no tensor"),
    "misshaped fc": ({"tensors": lambda w: w | {"fc.weight": w["fc.weight"][:, :191]}}, "fc.weight is [64, 191]"),
    "d2t out of range": ({"tensors": lambda w: _d2t_shifted(w, -1, 1000)}, "outside the target's vocabulary"),
    "d2t not one-to-one": ({"tensors": lambda w: _d2t_shifted(w, 0, 1)}, "two draft ids to one target id"),
    "capture ids out of range": ({"config": lambda c: c | {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}}, "capture layer ids [1, 2, 4]"),
    "default ids on 4 layers": ({"config": lambda c: {k: v for k, v in c.items() if k != "eagle_config"}},
                                "capture layer ids [1, 2, 2]"),
    "other hidden size": ({"config": lambda c: c | {"target_hidden_size": 32}}, "target_hidden_size 32"),
    "other vocabulary": ({"config": lambda c: c | {"vocab_size": 1024}}, "vocab_size 1024"),
    "two layers": ({"config": lambda c: c | {"num_hidden_layers": 2}}, "of 2 layers"),
    "truncated file": ({"raw": lambda b: b[:len(b) // 2]}, "unreadable"),
    "quantized": ({"tensors": lambda w: w | {"fc.scales": mx.ones((64, 3))}}, "does not load: fc.scales"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_drafter_is_refused_at_capability_time(target, tmp_path, case):
    change, why = BROKEN[case]
    drafter_checks.refused(target, broken(drafter_dir(target), tmp_path / "bad", **change), why)


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    bad = broken(drafter_dir(target), tmp_path / "bad", tensors=lambda w: _d2t_shifted(w, -1, 1000))
    drafter_checks.served_plain(target, NAME, bad)


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out (1 to 90 tokens), alone then 8 at once (their prefixes then cached:
    the drafter reads from where the target's forwards start), k = 3: plain decoding's tokens, every job
    speculating, and on the distilled prompts over half the drafts accepted (what the target's layers give)."""
    # Measured: 0.62 of drafts accepted on distilled prompts (0.27 with the target's layers zeroed: bigrams).
    drafter_checks.greedy_as_plain(target, NAME, drafter_dir(target))


def test_sampled_rounds_are_distributed_as_plain_sampling(target):
    """test_spec_sampling's distribution test (mtp_checks.sampled_as_plain) with the drafter, q scattered onto the
    target's vocabulary through d2t; its biased control (every draft accepted) is caught."""
    drafter_checks.sampled_as_plain(target, load_head, Eagle3Drafter)


def _mlx_vlm_drafter(drafter):
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config, TextConfig
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    c = json.loads((drafter / "config.json").read_text())
    layer = TextConfig(**{k: c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                                            "num_key_value_heads", "rms_norm_eps", "vocab_size", "rope_theta")},
                       num_hidden_layers=1)
    theirs = Eagle3DraftModel(Eagle3Config(transformer_layer_config=layer, draft_vocab_size=c["draft_vocab_size"],
                                           target_layer_ids=c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in mx.load(str(drafter / "model.safetensors")).items()}
    theirs.load_weights(list(theirs.sanitize(weights).items()), strict=False)
    return theirs


def test_the_drafter_drafts_as_mlx_vlms_eagle3_drafter(target):
    """mlx-vlm's Eagle3DraftModel on the same weights, fed the same tapped layers (its capture_layer_ids are the
    same layers): the same seed hidden and logits within 1e-5 (it numbers positions from 1, the node from 0: RoPE
    sees the same distances) and the same draft tokens, mapped through d2t, for a prompt and four draft steps."""
    model, _ = load(str(target))
    ours = load_head(target, model)
    theirs = _mlx_vlm_drafter(drafter_dir(target))
    assert theirs.config.capture_layer_ids == list(ours.tap.layers) == [0, 1, 2]
    ids = mx.array([train_prompts()[1] + list(range(40, 60))])
    model(ids)
    hidden, bonus = ours.tap.last, 77
    theirs.reset(model)
    theirs.prefill_from_target_hidden(ids, hidden, bonus, None, greedy=True)
    embed = model.model.embed_tokens
    cache = ours.make_cache()
    h = ours(embed(mx.concatenate([ids[:, 1:], mx.array([[bonus]])], axis=1)), hidden, cache)[:, -1:]
    assert mx.allclose(h, theirs._seed_hidden, atol=1e-5).item()
    assert mx.allclose(ours.draft_logits(h), theirs._logits(theirs._seed_hidden), atol=1e-5).item()
    drafted = []
    for step in range(4):
        token = ours.target_logits(h, 512).argmax(-1)
        drafted.append(token.item())
        if step < 3:
            h = ours(embed(token), h, cache)
    assert theirs.draft_block(bonus, hidden[:, -1:], None, 5, None, greedy=True).tolist() == [drafted]
    assert any(t >= 256 for t in ours.hot.tolist()) and set(drafted) <= set(ours.hot.tolist())


def test_the_books_are_what_loads(target):
    """Booked: the drafter's weights as it holds them loaded (t2d dropped, d2t as int32 target ids), its
    activations, and its KV per token as its cache holds it; the target's layer tap only with the drafter."""
    drafter = drafter_dir(target)
    model, head, config = drafter_checks.weights_and_activations_booked(target, drafter, load_head, eagle3, Eagle3Head)
    cache = head.make_cache()
    head(mx.zeros((1, 5, 64)), mx.zeros((1, 5, 192)), cache)
    per_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads x 16, float32
    assert sum(x[..., :5, :].nbytes for x in (cache[0].keys, cache[0].values)) == 5 * per_token
    assert EAGLE3.kv_shape(drafter, config).bytes_per_token_full == per_token
    assert install_layers(model, [0, 1, 2]) is head.tap  # installed once, by the drafter's load


def test_the_node_books_the_drafter_it_loads(target):
    """Through the residency: the drafter's reservation is its footprint, and the loaded pair's drafter KV shape
    (from which each batch's drafter KV is booked) is the drafter's."""
    drafter_checks.node_books_the_drafter(target, NAME, drafter_dir(target), Eagle3Head, EAGLE3.kv_shape)


def test_grammar_rows_speculate_with_the_drafter_as_plain_decoding_together(target):
    """Two rows under JSON schemas (drafts drawn under the grammar's masks, many of the allowed ids outside the
    draft vocabulary, where the drafter's logits are the lowest: never NaN), a free row and a sampled constrained
    row, together: each greedy row emits its plain run's tokens and the constrained ones validate."""
    drafter_checks.grammar_rows_as_plain_together(target, NAME, drafter_dir(target))


def test_the_speculators_layout_pairs_and_drafts_alike(target, tmp_path):
    """The same drafter in the Speculators layout (config nested in `transformer_layer_config`, the layer as
    `layers.0.*`, the target's embedding shipped with it): paired as eagle3 and the same logits."""
    flat = json.loads((drafter_dir(target) / "config.json").read_text())
    out = tmp_path / "speculators"
    out.mkdir()
    layer = {k: v for k, v in flat.items() if k not in ("architectures", "draft_vocab_size", "eagle_config")}
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
        "draft_vocab_size": flat["draft_vocab_size"], "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}))
    model, _ = load(str(target))
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in mx.load(str(drafter_dir(target) /
                                                                             "model.safetensors")).items()}
    weights["embed_tokens.weight"] = model.model.embed_tokens.weight
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    caps = caps_with(target, out)
    assert (caps.mtp_capable, caps.speculates_with, caps.drafter_reason) == (True, "eagle3", "ok"), caps
    ours, theirs = load_head(target, model), load_eagle3(out, model)
    assert "embed_tokens" in theirs and "embed_tokens" not in ours
    hidden, tokens = mx.random.normal((1, 6, 192)), mx.array([[5, 9, 300, 2, 77, 41]])
    a = ours(model.model.embed_tokens(tokens), hidden, None)
    b = theirs(theirs.embed_tokens(tokens), hidden, None)
    assert mx.array_equal(ours.target_logits(a, 512), theirs.target_logits(b, 512)).item()
