"""Speculation with a DFlash drafter: a block-diffusion drafter of its own, trained against its target, reading
several of the target's decoder layers and drafting a whole block in one forward (issue 42), through the real engine.

The fixture (fixture factory: `qwen3-dflash-tiny`) is fixtures' tiny Qwen3 target and a drafter in the published
layout beside it (fc, hidden_norm, layers.i.*, norm; dflash_config {mask_token_id, target_layer_ids}), distilled for
seconds on blocks of the target's greedy continuations of the training prompts: drafts on those are accepted often.
Greedy output must equal plain decoding; sampled output must be distributed as plain sampling."""

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from provider.engine.dflash_drafter import DFlashDrafter
from provider.jobs import Job, SamplingParams
from provider.memory import estimate
from provider.models import capability, dflash
from provider.models.dflash_head import DFlashHead, load_dflash
from provider.models.fixtures_dflash import drafter_dir
from provider.models.fixtures_mtp import train_prompts
from provider.models.footprint import dflash_kv_shape, drafter_footprint
from provider.types import SpecMode
from provider.verification.hidden_tap import install_layers
from tests import mtp_checks
from tests.helpers import collect, greedy, make_node, run

NAME = "qwen3-dflash-tiny"


@pytest.fixture(scope="module")
def target(head_fixture):
    return head_fixture(NAME)


def load_head(target, model):
    return load_dflash(drafter_dir(target), model)


def caps_with(target, drafter):
    config = capability.read_config(target)
    return capability.with_drafter(capability.detect(target, config), target, drafter, config)


def test_paired_as_dflash_from_config_and_headers_listed_and_registered(target):
    from coordinator_client.registration import model_infos
    from provider.model_commands import SPEC_TAGS, describe
    from provider.models.store import StoredModel
    from provider.settings import Settings

    caps = caps_with(target, drafter_dir(target))
    assert (caps.mtp_capable, caps.speculates_with, caps.drafter_reason) == (True, "dflash", "ok"), caps
    row = describe(Settings(), StoredModel(NAME, str(target), target, "configured", drafter=str(drafter_dir(target))),
                   1 << 30)
    assert (row["speculates_with"], row["mtp_capable"]) == ("dflash", True) and SPEC_TAGS["dflash"] == "  [dflash]"
    node = make_node({NAME: target}, manager_kw={"drafters": {NAME: drafter_dir(target)}})
    registered = {i.id: i.capabilities for i in model_infos(node.status())}[NAME]
    run(node.stop())
    assert (registered.mtp_capable, registered.speculates_with) == (True, "dflash")
    # Not taken for an EAGLE-3 drafter, nor an EAGLE-3 one for it.
    from provider.models.eagle3 import is_eagle3
    assert not is_eagle3(capability.read_config(drafter_dir(target)))


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
    "a DSpark drafter": ({"config": lambda c: c | {"architectures": ["DSparkDraftModel"]}}, "variant dspark"),
    "causal blocks": ({"config": lambda c: c | {"dflash_config": c["dflash_config"] | {"causal": True}}},
                      "causal blocks"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_malformed_drafter_is_refused_at_capability_time(target, tmp_path, case):
    change, why = BROKEN[case]
    caps = caps_with(target, _broken(drafter_dir(target), tmp_path / "bad", **change))
    assert not caps.mtp_capable and caps.speculates_with == "" and why in caps.drafter_reason, caps


def test_a_refused_drafter_leaves_the_target_served_plain(target, tmp_path):
    # Refused by its config alone: with the check off it would load and speculate.
    bad = _broken(drafter_dir(target), tmp_path / "bad", config=lambda c: c | {"num_target_layers": 36})
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
    model, _ = load(str(target))  # and a target loaded without a DFlash drafter carries no layer tap
    assert not any(hasattr(type(layer), "layer_tap") for layer in model.model.layers)


def test_greedy_equals_plain_decoding_alone_and_eight_together(target):
    """Four distilled prompts and four held out (1 to 90 tokens), alone then 8 at once (their prefixes then cached:
    the drafter's positions skip them), k = 3: plain decoding's tokens, every job speculating, and on the
    distilled prompts over half the drafts accepted (what the target's layers give)."""
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
        assert sum(s.accepted for s in spec[:4]) > sum(s.drafted for s in spec[:4]) // 2, spec
    # Together, some prompts' prefixes came from the prefix cache: the drafter's positions skipped them.
    assert any(done.telemetry.cached_prompt_tokens > 0 for _, _, done, _ in together)


def test_sampled_rounds_are_distributed_as_plain_sampling(target):
    """test_spec_sampling's distribution test (mtp_checks.sampled_as_plain) with the drafter: each draft of a
    block drawn from its own position's q; its biased control (every draft accepted) is caught."""
    params = SamplingParams(max_tokens=6, temperature=0.15, top_p=0.95, top_k=32, seed=3)
    mtp_checks.sampled_as_plain(target, load_head, train_prompts()[0], params, drafter=DFlashDrafter)


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
    config = capability.read_config(drafter)
    model, _ = load(str(target))
    head = load_head(target, model)
    assert isinstance(head, DFlashHead)
    held = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    assert dflash.weight_bytes(drafter) == held
    assert drafter_footprint(drafter, config, SpecMode.MTP, 3, 512) - held == \
        estimate.activation_bytes(dflash.flat_config(config), 512, attention_only=True)
    cache = head.make_cache()
    head.context(mx.zeros((1, 5, 128)), cache, 0)
    per_token = 2 * 2 * 2 * 16 * 4  # 2 layers, K and V, 2 KV heads x 16, float32
    assert sum(x[..., :5, :].nbytes for c in cache for x in (c.keys, c.values)) == 5 * per_token
    assert dflash_kv_shape(drafter, config).bytes_per_token_full == per_token
    assert install_layers(model, [0, 1]) is head.tap  # installed once, by the drafter's load


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
    assert lm.drafter_mode is SpecMode.MTP and isinstance(lm.drafter, DFlashHead)
    assert lm.draft_kv_shape == dflash_kv_shape(drafter, config)


def test_grammar_rows_speculate_with_the_drafter_as_plain_decoding_together(target):
    """Two rows under JSON schemas (each block's drafts drawn position by position under the grammar's masks), a
    free row and a sampled constrained row, together: each greedy row emits its plain run's tokens and the
    constrained ones validate."""
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
        if i != 2:
            jsonschema.validate(json.loads(text), schemas[min(i, 1)])
    assert together[2][2].telemetry.speculation.accepted > 0
