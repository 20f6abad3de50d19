"""What every MTP head family's tests check (issue 42), run the same way for each: tests/test_mtp_families.py (dense
Qwen3.5), test_mtp_qwen_moe.py, test_mtp_glm.py, test_mtp_nemotron.py. Each test keeps its family's own figures
(prompts, sampling parameters, acceptance bounds) and its own extra assertions."""

import asyncio
import itertools
import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step

from provider.engine.acceptance import SampledChoice
from provider.engine.proposers import HeadDrafter
from provider.engine.spec_rounds import Speculator
from provider.jobs import Job, SamplingParams
from provider.memory import estimate
from provider.models import capability
from provider.memory.checkpoint import open_checkpoint
from tools.fixtures.mtp import train_prompts
from provider.drafters.mtp.kind import KIND as NATIVE_HEAD
from provider.models.gemma4_target import Target
from provider.telemetry import SpecTelemetry
from provider.proofs.hidden_tap import install
from tests.helpers import collect, greedy, make_node, run
from tools.harness.distribution import AcceptEveryDraft, compare, plain_samples

# The JSON schemas (and the message asking for JSON) the grammar tests' constrained rows decode under.
JSON_SCHEMAS = [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "kind": {"enum": ["capital", "town", "village"]}},
                 "required": ["name", "kind"]},
                {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "ok": {"type": "boolean"}}, "required": ["n", "ok"]}]
JSON_MESSAGES = ({"role": "user", "content": "Describe a place as JSON."},)


def prompts(target) -> list[list[int]]:
    """Eight prompts: four the head was distilled on, four held out of 1 to 90 tokens (past the head's
    first read of a chunk, and one of a single token, which gives the head no prompt pair at all)."""
    _, tok = load(str(target))
    text = tok.encode("The provider node serves language models to a network of clients. " * 6)
    return train_prompts()[:4] + [text[:1], text[3:10], text[5:40], text[:90]]


def plain(target, prompt, n):
    """mlx-lm's plain greedy decoding of n tokens (it does not stop at the end token)."""
    model, _ = load(str(target))
    return [t for t, _ in itertools.islice(generate_step(mx.array(prompt), model, max_tokens=n), n)]


def head_found(path, config):
    """The capabilities registration reads from the checkpoint at `path` (config and safetensors headers) find its
    one head, and with it the target speculates. Returns them."""
    caps = capability.with_drafter(capability.detect(path, config), path, None, config)
    assert (caps.native_mtp_heads, caps.native_mtp_declared, caps.mtp_capable, caps.drafter_reason) == \
        (True, 1, True, "ok"), caps
    return caps


def found_but_not_when_stripped(target, out, is_head) -> dict:
    """`head_found` on the checkpoint at `target`; a copy at `out` without the tensors `is_head(name)` picks, its
    config still declaring the head (what mlx-community conversions ship: sanitize dropped them), has none.
    Returns the config."""
    config = capability.read_config(target)
    head_found(target, config)
    no_head_found(rewritten(target, out, lambda w: {k: v for k, v in w.items() if not is_head(k)}), config)
    return config


def no_head_found(path, config) -> None:
    """The checkpoint at `path` (a head declared in `config`, its tensors gone) has no head to speculate with."""
    caps = capability.with_drafter(capability.detect(path, config), path, None, config)
    assert not caps.native_mtp_heads and not caps.mtp_capable and caps.drafter_reason == "not_mtp_capable", caps


def booked_once(target, config, load_head):
    """The head is booked once, as the drafter, never inside the target: the target's weight estimate is what
    mlx-lm's load holds (its sanitize drops the head's tensors), to the byte; the checkpoint's tensors are that plus
    the head as `load_head` loads it; the drafter's footprint is that head plus activations. Returns the model and
    the head."""
    model, _ = load(str(target))
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert estimate.weight_bytes(config, open_checkpoint(target).tensors) == held
    head = load_head(target, model)
    head_bytes = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    assert held + head_bytes == sum(v.nbytes for v in mx.load(str(target / "model.safetensors")).values())
    assert NATIVE_HEAD.footprint(target, config, 3, 512) - head_bytes == \
        estimate.activation_bytes(config, 512, attention_only=True)
    return model, head


def first_layer_alone(target, out, more_layers, config_change: dict, load_head):
    """A copy of `target` at `out` with more MTP layers (`more_layers` adds their tensors, `config_change` declares
    them) is still capable, and served with the first, which alone is read and booked (footprint: that head plus
    activations). Returns the head loaded from it."""
    more = rewritten(target, out, more_layers, config_change)
    config = capability.read_config(more)
    assert capability.with_drafter(capability.detect(more, config), more, None, config).mtp_capable
    head = load_head(more, load(str(more))[0])
    assert NATIVE_HEAD.footprint(more, config, 3, 512) - sum(v.nbytes for _, v in tree_flatten(
        head.parameters())) == estimate.activation_bytes(config, 512, attention_only=True)
    return head


def books_as_held(target, config, load_head, per_token: int, own_parts: bool, pairs: int = 5,
                  own_lm_head: bool | None = None):
    """`booked_once`; the head's embedding and LM head its own (`own_parts`) or the target's (its LM head alone
    its own: `own_lm_head`); its KV booked as `per_token` bytes a token, which is what its cache holds after `pairs`
    pairs (`cache_holds`). Returns the head."""
    _, head = booked_once(target, config, load_head)
    assert (head.lm_head is not None, "embed_tokens" in head) == \
        (own_parts if own_lm_head is None else own_lm_head, own_parts)
    assert NATIVE_HEAD.kv_shape(target, config).bytes_per_token_full == per_token
    cache_holds(head, per_token, pairs)
    return head


def cache_holds(head, per_token: int, pairs: int = 5, width: int = 64) -> None:
    """After `pairs` zero pairs of `width`, the head's fresh cache (each of a CacheList's) holds `per_token` bytes a
    pair in its keys and values, byte for byte."""
    cache = head.make_cache()
    head(mx.zeros((1, pairs, width)), mx.zeros((1, pairs, width)), cache)
    assert [c.offset for c in _flat(cache)] == [pairs] * len(_flat(cache))
    assert sum(x[..., :c.offset, :].nbytes for c in _flat(cache) for x in (c.keys, c.values)) == pairs * per_token


def computes_the_reference(target, prefix: str, load_head, reference, held_out: int, own_parts: bool = False):
    """The head as `load_head` loads it against `reference(w, config, embeddings, hidden)`, the family's published
    step in plain MLX operations from its tensors `w` (`prefix` off), on a prompt's pairs (a distilled prompt then
    `held_out` held-out tokens): in one read without a cache, and read in chunks of 8 into its cache then stepped 3
    times on its own drafts (the reference rerun over the whole sequence each time): the same hidden states within
    float32 rounding and the same draft tokens. It embeds and reads out with its own parts (`own_parts`) or the
    target's (its own LM head wherever it ships one), through its readout, fed the target's hidden its tap reads
    (the final norm's output without one). Returns the tensors and the head."""
    config = json.loads((target / "config.json").read_text())
    w = {k[len(prefix):]: v for k, v in mx.load(str(target / "model.safetensors")).items() if k.startswith(prefix)}
    model, tap, head = loaded(target, load_head)
    ids = mx.array([train_prompts()[0] + prompts(target)[-1][:held_out]])
    model(ids)
    hidden = (head.tap or tap).last
    embed = head.embed_tokens if own_parts else model.model.embed_tokens
    own_lm_head = head.lm_head or model.lm_head

    def lm_head(h):
        return own_lm_head(head.readout(h))

    tokens = mx.concatenate([ids[:, 1:], mx.array([[77]])], axis=1)
    want = reference(w, config, embed(tokens), hidden)
    assert mx.allclose(head(embed(tokens), hidden, None), want, atol=2e-5, rtol=1e-4).item()
    cache = head.make_cache()
    for i in range(0, tokens.shape[1], 8):
        h = head(embed(tokens[:, i:i + 8]), hidden[:, i:i + 8], cache)
    assert mx.allclose(h[:, -1], want[:, -1], atol=2e-5, rtol=1e-4).item()
    h = h[:, -1:]
    for _ in range(3):
        token = lm_head(h).argmax(-1)
        tokens, hidden = mx.concatenate([tokens, token], axis=1), mx.concatenate([hidden, h], axis=1)
        want = reference(w, config, embed(tokens), hidden)[:, -1:]
        h = head(embed(token), h, cache)
        assert mx.allclose(h, want, atol=2e-5, rtol=1e-4).item()
        assert lm_head(h).argmax(-1).item() == lm_head(want).argmax(-1).item()
    return w, head


def rms_norm(eps: float):
    """RMSNorm in plain MLX operations, for the families' references: (x, g) -> x / rms(x) * g."""
    return lambda x, g: x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * g


def rotate_half(x: mx.array, theta: float, rotated: int) -> mx.array:
    """Rotate-half RoPE in plain MLX operations, for the families' references: x [B, n, L, d] at positions 0..L-1,
    the first `rotated` dims of each head rotated with base `theta`, the rest passed."""
    angles = mx.arange(x.shape[2])[:, None] * (theta ** (-mx.arange(0, rotated, 2) / rotated))[None]
    cos, sin = mx.cos(angles), mx.sin(angles)
    x1, x2 = x[..., : rotated // 2], x[..., rotated // 2: rotated]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotated:]], axis=-1)


def loaded(target, load_head):
    """The target as mlx-lm loads it, its hidden-state tap, and its head as the family's `load_head` loads it."""
    model, _ = load(str(target))
    tap = install(model)
    return model, tap, load_head(target, model)


def greedy_alone_and_together(target, name, ps, want, n, then=None, drafter=None):
    """Each prompt of `ps` as a greedy job of n tokens alone, then all together, through a node speculating with
    the head (k = 3): every job speculated (mode mtp, reason ok, rounds run) and emitted `want[i]`, plain
    decoding's tokens. `then(node)` (a coroutine function) runs on the same node after them. `drafter`: a drafter
    checkpoint configured for the target (EAGLE-3), else its own head. Returns (alone, together, what `then`
    returned)."""
    node = make_node({name: target}, max_concurrent_jobs=8, speculation="on", speculation_k=3,
                     manager_kw={"drafters": {name: drafter}} if drafter else None)

    async def main():
        try:
            alone = [await collect(node, Job(f"a{i}", name, greedy(n), prompt_ids=tuple(p)))
                     for i, p in enumerate(ps)]
            together = await asyncio.gather(*(collect(node, Job(f"t{i}", name, greedy(n), prompt_ids=tuple(p)))
                                              for i, p in enumerate(ps)))
            return alone, together, then and await then(node)
        finally:
            await node.stop()

    alone, together, later = run(main())
    for kind, results in (("alone", alone), ("together", together)):
        for i, (ids, _, done, _) in enumerate(results):
            spec = done.telemetry.speculation
            assert (spec.mode.value, spec.reason) == ("mtp", "ok") and spec.rounds > 0, (kind, i, spec)
            assert ids == want[i], f"{kind} job {i} ({len(ps[i])} prompt tokens)"
    return alone, together, later


def rewritten(target, out, change, config_change: dict | None = None):
    """A copy of the checkpoint at `target` whose tensors `change` rewrote (a dict in, a dict out; tagged "pt" as
    the fixtures are), its config updated by `config_change` if given. Returns its path."""
    shutil.copytree(target, out)
    weights = change(dict(mx.load(str(out / "model.safetensors"))))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    if config_change:
        (out / "config.json").write_text(json.dumps(json.loads((out / "config.json").read_text()) | config_change))
    return out


def until_eos(path, tokens: list[int]) -> list[int]:
    """Plain decoding's tokens as the node emits them: it stops at the end token (mlx-lm's generate_step does not)."""
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


def refused_and_served_plain(bad, target, name: str, load_head) -> None:
    """A broken head in the checkpoint at `bad` (a copy of `target`): its headers still show a head (capability
    holds), `load_head` refuses it with a ValueError, and a node (auto) serves two held-out prompts plain with the
    reason, their output plain decoding's."""
    head_found(bad, capability.read_config(bad))
    model, _ = load(str(bad))
    with pytest.raises(ValueError):
        load_head(bad, model)
    ps = prompts(target)[4:6]
    node = make_node({name: bad}, speculation="auto", speculation_k=3)

    async def main():
        out = [await collect(node, Job(f"b{i}", name, greedy(8), prompt_ids=tuple(p))) for i, p in enumerate(ps)]
        await node.stop()
        return out

    for p, (ids, _, done, _) in zip(ps, run(main())):
        spec = done.telemetry.speculation
        assert spec.mode.value == "off" and spec.reason == "no_drafter", spec
        assert ids == until_eos(bad, plain(bad, p, 8))


def refused_when_broken(target, out, name: str, load_head, broken: str, cut: str, drop: dict) -> None:
    """`refused_and_served_plain` on a copy of `target` at `out`, its head broken: the tensors named from
    `drop[broken]` on dropped, or (`broken` not in `drop`) the tensor `cut` cut to 127 input columns."""
    change = (lambda w: {k: v for k, v in w.items() if not k.startswith(drop[broken])}) if broken in drop else \
        (lambda w: w | {cut: w[cut][:, :127]})
    refused_and_served_plain(rewritten(target, out, change), target, name, load_head)


def greedy_as_plain(target, name: str, n: int = 16, accepted: float | None = None):
    """`greedy_alone_and_together` on `prompts(target)` (1 to 90 tokens) against plain decoding's n tokens as the node
    emits them, the 8 verified together; with `accepted`, more than that share of the drafts accepted on the four
    prompts the head was distilled on (alone). Returns (prompts, alone, together)."""
    ps = prompts(target)
    want = [until_eos(target, plain(target, p, n)) for p in ps]
    alone, together, _ = greedy_alone_and_together(target, name, ps, want, n)
    assert together[0][2].telemetry.speculation.mean_batch > 2  # verified together with the others
    if accepted is not None:
        spec = [done.telemetry.speculation for _, _, done, _ in alone[:4]]
        assert sum(s.accepted for s in spec) > accepted * sum(s.judged for s in spec), spec
    return ps, alone, together


def same_parameters(mine: dict, other: dict) -> None:
    """Two heads' flattened parameters: the same names, each bit for bit."""
    assert mine.keys() == other.keys()
    assert [k for k in mine if not mx.array_equal(mine[k], other[k]).item()] == []


def drafts_as_mlx_vlms(target, model, tap, ours, theirs, embed, lm_head, k_tol=0.0):
    """Ours against mlx-vlm's drafter `theirs` on the prompt's pairs (a distilled prompt then 20 held-out tokens,
    first token 77) then four draft steps, ours stepped here with the family's `embed` and `lm_head`: the same seed
    hidden state and draft tokens bit for bit, and the same K/V: V bit for bit, K within `k_tol` (0: bit for bit).
    Returns the prompt and our head's cache."""
    ids = mx.array([train_prompts()[0] + prompts(target)[-1][:20]])
    model(ids)
    hidden, bonus = tap.last, 77
    theirs.reset(model)
    theirs.prefill_from_target_hidden(ids, hidden, bonus, None, greedy=True)
    cache = ours.make_cache()
    h = ours(embed(mx.concatenate([ids[:, 1:], mx.array([[bonus]])], axis=1)), hidden, cache)[:, -1:]
    assert mx.array_equal(h, theirs._seed_hidden).item()
    drafted = []
    for step in range(4):
        token = lm_head(h).argmax(-1)
        drafted.append(token.item())
        if step < 3:  # the fourth draft needs no step after it
            h = ours(embed(token), h, cache)
    assert theirs.draft_block(bonus, hidden[:, -1:], None, 5, None, greedy=True).tolist() == [drafted]
    assert len(cache) == len(theirs._cache)
    for a, b in zip(_flat(cache), _flat(theirs._cache)):
        keys, their_keys = a.keys[..., :a.offset, :], b.keys[..., :b.offset, :]
        assert a.offset == b.offset
        assert (mx.allclose(keys, their_keys, rtol=k_tol, atol=k_tol) if k_tol else
                mx.array_equal(keys, their_keys)).item()
        values, their_values = a.values[..., :a.offset, :], b.values[..., :b.offset, :]
        if their_values.shape[-1] == 0:  # unused values (DSA's indexer): mlx-vlm stores none, mlx-lm zeros
            their_values = mx.zeros_like(values)
        assert mx.array_equal(values, their_values).item()
    return ids, cache


def _flat(caches: list) -> list:
    """The caches in a list of layer caches, a CacheList's (DSA: the latent's and the indexer's) each its own."""
    return [c for layer in caches for c in getattr(layer, "caches", [layer])]


def sampled(model, head, prompt, params, n, k, choice=SampledChoice, seed0=0, positions=6, drafter=HeadDrafter):
    """n speculative samples of the first `positions` tokens (seeds seed0, seed0 + 1, ...): rows of the engine's
    round loop with the head, 400 at a time, each reading the prompt itself as a fresh job does (the harness's
    rows start from one read prompt, which leaves a head no prompt pairs and accepts a fifth as often)."""
    spec, total, out = Speculator(model, drafter(head, Target(model))), SpecTelemetry("sampled", k=k), []
    for start in range(seed0, seed0 + n, 400):
        rows = [spec.new_row(prompt, stats=SpecTelemetry("sampled", k=k), choice=choice(params, seed))
                for seed in range(start, min(start + 400, seed0 + n))]
        for row in rows:
            while not spec.read(row, 2048):
                pass
        samples = [[first] for first in spec.begin(rows)]
        while live := [i for i, s in enumerate(samples) if len(s) < positions]:
            for i, tokens in zip(live, spec.round([rows[i] for i in live])):
                samples[i] += tokens
        out += [tuple(s[:positions]) for s in samples]
        total.accepted += sum(r.stats.accepted for r in rows)
        total.judged += sum(r.stats.judged for r in rows)
    return out, total


def sampled_as_plain(target, load_head, prompt=None, params=None, drafter=HeadDrafter) -> None:
    """test_spec_sampling's distribution test with the head: the first 6 tokens, k = 3, 800 samples a side; a
    chi-square per position does not tell speculative sampling from the node's plain sampler, both of the round's
    branches ran hundreds of times, and the test tells the biased control (every draft accepted, k = 2) apart.
    By default on the first distilled prompt at T = 0.7 with top_p 0.95 and top_k 32 (most families' figures)."""
    prompt = train_prompts()[0] if prompt is None else prompt
    params = params or SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, top_k=32, seed=3)
    model, _, head = loaded(target, load_head)
    reference = plain_samples(model, prompt, params, 800, 6)
    spec, stats = sampled(model, head, prompt, params, 800, 3, drafter=drafter)
    assert stats.accepted > 200 and stats.judged - stats.accepted > 200, stats  # both branches, many times
    rows = compare(reference, spec, 6)
    assert all(r["p"] >= 1e-3 for r in rows), rows
    biased, _ = sampled(model, head, prompt, params, 200, 2, choice=AcceptEveryDraft, seed0=10**6, drafter=drafter)
    assert min(r["p"] for r in compare(reference, biased, 6)) < 1e-3  # the test has the power to see a bias


def draws_through_the_shared_rule(target, load_head, prompt=None, params=None, drafter=HeadDrafter, k: int = 4):
    """What a family adds to speculative sampling, checked where the distribution battery (sampled_as_plain) runs
    once per engine drafter class (test_mtp_families: HeadDrafter; test_dflash: DFlashDrafter;
    test_eagle3; test_spec_sampling: draft models; test_constrained_engine: under a grammar). Lossless sampling
    needs only that each draft is drawn from the q it reports and judged by the shared accept rule; a family's head
    decides the logits, not the draw (its target's rollback: its greedy tests). So: the family drafts through one
    of those classes, unchanged; every draft it proposes is what acceptance.draw_drafts drew, one call per
    position; each q is a distribution that gives its draft mass. Three sampled rows (seeds 0-2) of `prompt`, as
    the battery's `params` sample them."""
    import importlib

    from provider.engine import acceptance

    classes = {name: getattr(importlib.import_module(module), name) for module, name in BATTERY_CLASSES}
    assert classes.get(drafter.__name__) is drafter, f"{drafter.__name__} has no sampling battery"
    prompt = train_prompts()[0] if prompt is None else prompt
    params = params or SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, top_k=32, seed=3)
    model, _, head = loaded(target, load_head)
    engine_drafter = drafter(head, Target(model))
    assert type(engine_drafter) is drafter  # noqa: E721 (a family subclass would draw its own way)
    spec = Speculator(model, engine_drafter)
    rows = [spec.new_row(prompt, stats=SpecTelemetry("s", k=k), choice=SampledChoice(params, seed))
            for seed in range(3)]
    for row in rows:
        while not spec.read(row, 2048):
            pass
    spec.begin(rows)
    drawn, real = [], acceptance.draw_drafts
    module = importlib.import_module(drafter.__module__)

    def spy(rows, logits, qs, select=None):
        drawn.append(real(rows, logits, qs, select))
        return drawn[-1]

    module.draw_drafts = spy
    try:
        drafts, qs = engine_drafter.propose(rows, k, [])
    finally:
        module.draw_drafts = real
    assert len(drawn) == k and mx.array_equal(mx.concatenate(drawn, axis=1), drafts).item(), (drawn, drafts)
    assert [len(q) for q in qs] == [k] * len(rows)
    for i, row_qs in enumerate(qs):
        for j, q in enumerate(row_qs):
            q = q.astype(mx.float32).reshape(-1)
            assert abs(q.sum().item() - 1) < 1e-3 and q.min().item() >= 0, (i, j)
            assert q[drafts[i, j].item()].item() > 0, (i, j)  # drawn from this q


# The engine's drafter classes whose sampled rounds the distribution battery runs (module, class).
BATTERY_CLASSES = (("provider.engine.proposers", "HeadDrafter"), ("provider.engine.proposers", "Eagle3Drafter"),
                   ("provider.engine.dflash_drafter", "DFlashDrafter"))
