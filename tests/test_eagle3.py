"""Speculation with an EAGLE-3 drafter: a checkpoint of its own, trained against its target, reading three of the
target's decoder layers (issue 42), through the real engine.

The fixture (fixture factory: `llama-eagle3-tiny`) is fixtures' tiny Llama target and a drafter in the published
layout beside it (fc, midlayer.*, norm, lm_head over a 256-id draft vocabulary, d2t, t2d), distilled for seconds on
the target's greedy continuations of the training prompts: drafts on those are accepted often, on other text seldom.
Greedy output must equal plain decoding; sampled output must be distributed as plain sampling."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from provider.engine.drafters import Eagle3Drafter
from provider.jobs import Job, SamplingParams
from provider.memory import estimate
from provider.models import capability, eagle3
from provider.models.eagle3_head import Eagle3Head, load_eagle3
from provider.models.fixtures_eagle3 import drafter_dir
from provider.models.fixtures_mtp import train_prompts
from provider.models.footprint import drafter_footprint, eagle3_kv_shape
from provider.types import SpecMode
from provider.verification.hidden_tap import install_layers
from tests import mtp_checks
from tests.helpers import collect, greedy, make_node, run

NAME = "llama-eagle3-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def load_head(target, model):
    return load_eagle3(drafter_dir(target), model)


def caps_with(target, drafter):
    config = capability.read_config(target)
    return capability.with_drafter(capability.detect(target, config), target, drafter, config)


def test_paired_as_eagle3_from_config_and_headers_listed_and_registered(target):
    from provider.model_commands import SPEC_TAGS, describe
    from provider.models.store import StoredModel
    from provider.settings import Settings

    caps = caps_with(target, drafter_dir(target))
    assert (caps.mtp_capable, caps.speculates_with, caps.drafter_reason) == (True, "eagle3", "ok"), caps
    row = describe(Settings(), StoredModel(NAME, str(target), target, "configured", drafter=str(drafter_dir(target))),
                   1 << 30)
    assert (row["speculates_with"], row["mtp_capable"]) == ("eagle3", True) and SPEC_TAGS["eagle3"] == "  [eagle3]"
    from coordinator_client.registration import model_infos

    node = make_node({NAME: target}, manager_kw={"drafters": {NAME: drafter_dir(target)}})
    registered = {i.id: i.capabilities for i in model_infos(node.status())}[NAME]
    run(node.stop())
    assert (registered.mtp_capable, registered.speculates_with) == (True, "eagle3")
    # The three captured layers' inputs: the outputs of target layers 0, 1 and 2 (of 4).
    flat = eagle3.flat_config(capability.read_config(drafter_dir(target)))
    assert eagle3.tapped_layers(flat, 4) == [0, 1, 2]


def _broken(drafter, out, config=None, tensors=None, raw=None):
    """A copy of the drafter with its config (a dict in, a dict out), its tensors (likewise) or its file's bytes
    rewritten."""
    shutil.copytree(drafter, out)
    if config:
        (out / "config.json").write_text(json.dumps(config(json.loads((out / "config.json").read_text()))))
    if tensors:
        weights = tensors(dict(mx.load(str(out / "model.safetensors"))))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    if raw:
        (out / "model.safetensors").write_bytes(raw((out / "model.safetensors").read_bytes()))
    return out


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
    caps = caps_with(target, _broken(drafter_dir(target), tmp_path / "bad", **change))
    assert not caps.mtp_capable and caps.speculates_with == "" and why in caps.drafter_reason, caps


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    bad = _broken(drafter_dir(target), tmp_path / "bad", tensors=lambda w: _d2t_shifted(w, -1, 1000))
    prompt, n = train_prompts()[0], 12
    node = make_node({NAME: target}, speculation="auto", manager_kw={"drafters": {NAME: bad}})

    async def main():
        try:
            return await collect(node, Job("p", NAME, greedy(n), prompt_ids=tuple(prompt)))
        finally:
            await node.stop()

    ids, _, done, _ = run(main())
    assert hasattr(done, "telemetry"), done
    spec = done.telemetry.speculation
    assert (spec.rounds, spec.mode.value, spec.reason) == (0, "off", "no_drafter"), spec
    assert ids == mtp_checks.plain(target, prompt, n)
    model, _ = load(str(target))  # and a target loaded without an EAGLE-3 drafter carries no layer tap
    assert not any(hasattr(type(layer), "layer_tap") for layer in model.model.layers)


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out (1 to 90 tokens), alone then 8 at once (their prefixes then cached:
    the drafter reads from where the target's forwards start), k = 3: plain decoding's tokens, every job
    speculating, and on the distilled prompts over half the drafts accepted (what the target's layers give)."""
    n = 16
    _, tok = load(str(target))
    end = set(tok.eos_token_ids)  # the node stops at an end token, mlx-lm's plain decoding here does not
    clean = [(p, w) for p in train_prompts() + mtp_checks.prompts(target)[4:]
             if not end & set(w := mtp_checks.plain(target, p, n))]
    distilled = [c for c in clean if c[0] in train_prompts()][:4]
    ps, want = map(list, zip(*distilled + [c for c in clean if c[0] not in train_prompts()][:4]))
    assert len(ps) == 8
    alone, together, _ = mtp_checks.greedy_alone_and_together(target, NAME, ps, want, n, drafter=drafter_dir(target))
    for results in (alone, together):
        spec = [done.telemetry.speculation for _, _, done, _ in results]
        # Measured: 0.62 of drafts accepted on distilled prompts (0.27 with the target's layers zeroed: bigrams).
        assert sum(s.accepted for s in spec[:4]) > sum(s.drafted for s in spec[:4]) // 2, spec


def test_sampled_rounds_are_distributed_as_plain_sampling(target):
    """test_spec_sampling's distribution test (mtp_checks.sampled_as_plain) with the drafter, q scattered onto the
    target's vocabulary through d2t; its biased control (every draft accepted) is caught."""
    params = SamplingParams(max_tokens=6, temperature=0.15, top_p=0.95, top_k=32, seed=3)
    mtp_checks.sampled_as_plain(target, load_head, train_prompts()[0], params, drafter=Eagle3Drafter)


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
    config = capability.read_config(drafter)
    model, _ = load(str(target))
    head = load_head(target, model)
    assert isinstance(head, Eagle3Head)
    held = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    assert eagle3.weight_bytes(drafter) == held
    assert drafter_footprint(drafter, config, SpecMode.MTP, 3, 512) - held == \
        estimate.activation_bytes(eagle3.flat_config(config), 512, attention_only=True)
    cache = head.make_cache()
    head(mx.zeros((1, 5, 64)), mx.zeros((1, 5, 192)), cache)
    per_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads x 16, float32
    assert sum(x[..., :5, :].nbytes for x in (cache[0].keys, cache[0].values)) == 5 * per_token
    assert eagle3_kv_shape(drafter, config).bytes_per_token_full == per_token
    assert install_layers(model, [0, 1, 2]) is head.tap  # installed once, by the drafter's load


def test_the_node_books_the_drafter_it_loads(target):
    """Through the residency: the drafter's reservation is its footprint, and the loaded pair's drafter KV shape
    (from which each batch's drafter KV is booked) is the drafter's."""
    node = make_node({NAME: target}, speculation="on", speculation_k=3,
                     manager_kw={"drafters": {NAME: drafter_dir(target)}})

    async def main():
        try:
            await collect(node, Job("b", NAME, greedy(4), prompt_ids=tuple(train_prompts()[0])))
            entry = node.models._entries[NAME]
            return entry.drafter_bytes, entry.lm
        finally:
            await node.stop()

    booked, lm = run(main())
    drafter = drafter_dir(target)
    config = capability.read_config(drafter)
    assert booked == drafter_footprint(drafter, config, SpecMode.MTP, 3, node.models._prefill_step) > 0
    assert lm.drafter_mode is SpecMode.MTP and isinstance(lm.drafter, Eagle3Head)
    assert lm.draft_kv_shape == eagle3_kv_shape(drafter, config)


def test_grammar_rows_speculate_with_the_drafter_as_plain_decoding_together(target):
    """Two rows under JSON schemas (drafts drawn under the grammar's masks, many of the allowed ids outside the
    draft vocabulary, where the drafter's logits are the lowest: never NaN), a free row and a sampled constrained
    row, together: each greedy row emits its plain run's tokens and the constrained ones validate."""
    import asyncio

    import jsonschema

    from provider.constraints import OutputRules, ResponseFormat

    schemas = [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                 "kind": {"enum": ["capital", "town", "village"]}},
                "required": ["name", "kind"]},
               {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 99},
                                                 "ok": {"type": "boolean"}}, "required": ["n", "ok"]}]
    messages = ({"role": "user", "content": "Describe a place as JSON."},)

    def jobs(tag: str, speculation: str) -> list[Job]:
        return [*(Job(f"{tag}s{i}", NAME, greedy(48), messages=messages, speculation=speculation,
                      rules=OutputRules(ResponseFormat("json_schema", s, "x"))) for i, s in enumerate(schemas)),
                Job(f"{tag}f", NAME, greedy(16), prompt_ids=tuple(train_prompts()[0]), speculation=speculation),
                Job(f"{tag}t", NAME, SamplingParams(max_tokens=48, temperature=0.7), messages=messages,
                    speculation=speculation, rules=OutputRules(ResponseFormat("json_schema", schemas[1], "x")))]

    async def main():
        node = make_node({NAME: target}, max_concurrent_jobs=4, speculation_k=3,
                         manager_kw={"drafters": {NAME: drafter_dir(target)}})
        try:
            plain = [await collect(node, j) for j in jobs("off", "off")]
            return plain, await asyncio.gather(*(collect(node, j) for j in jobs("on", "on")))
        finally:
            await node.stop()

    plain, together = run(main())
    for i, ((ids, text, done, _), (want, _, _, _)) in enumerate(zip(together, plain)):
        spec = done.telemetry.speculation
        assert (spec.mode.value, spec.reason) == ("mtp", "ok") and spec.rounds > 0, (i, spec)
        if i < 3:
            assert ids == want, f"job {i}: speculation changed the output"
        if i != 2:  # the sampled row too: its draft distributions are never NaN, all its drafts valid
            jsonschema.validate(json.loads(text), schemas[min(i, 1)])
    assert together[2][2].telemetry.speculation.accepted > 0


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
