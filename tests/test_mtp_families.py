"""Speculation with an MTP head shipped inside the target's checkpoint (issue 42), through the real engine.

The fixture is a tiny hybrid Qwen3.5 (Gated DeltaNet and full-attention layers) in Hugging Face's layout with
`mtp.*` head weights, built by the fixture factory and its head distilled briefly on its target's greedy
continuations of a few prompts (`fixtures_mtp.train_prompts`): on those its drafts are often accepted, elsewhere
seldom, so rounds accept every number of drafts from 0 to k. Greedy output must equal plain decoding."""

import asyncio
import itertools

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from provider.engine.acceptance import SampledChoice
from provider.engine.drafters import HeadDrafter
from provider.engine.spec_rounds import Speculator
from provider.jobs import Job, SamplingParams
from provider.models import capability
from provider.models.fixtures_mtp import train_prompts
from provider.models.footprint import drafter_footprint, head_kv_shape
from provider.models.gemma4_target import Target
from provider.models.qwen3_5_mtp import load_head
from provider.telemetry import SpecTelemetry
from provider.types import SpecMode
from provider.verification.hidden_tap import install
from tests.helpers import collect, greedy, make_node, run
from tools.harness.distribution import AcceptEveryDraft, compare, plain_samples

NAME = "qwen3_5-mtp-tiny"


@pytest.fixture(scope="module")
def target(fixtures_dir):
    return fixtures_dir / NAME


def prompts(target) -> list[list[int]]:
    """Eight prompts: four the head was distilled on, four held out of 1 to 90 tokens (past the head's
    first read of a chunk, and one of a single token, which gives the head no prompt pair at all)."""
    _, tok = load(str(target))
    text = tok.encode("The provider node serves language models to a network of clients. " * 6)
    return train_prompts()[:4] + [text[:1], text[3:10], text[5:40], text[:90]]


def plain(target, prompt, n):
    model, _ = load(str(target))
    return [t for t, _ in itertools.islice(generate_step(mx.array(prompt), model, max_tokens=n), n)]


def test_capability_is_read_from_config_and_head_tensors(target, tmp_path):
    config = capability.read_config(target)
    caps = capability.with_drafter(capability.detect(target, config), target, None, config)
    assert caps.native_mtp_heads and caps.native_mtp_declared == 1
    assert (caps.mtp_capable, caps.drafter_reason) == (True, "ok")
    # The key without the tensors (what mlx-community conversions ship) is not a head.
    import json
    import shutil

    from mlx.core import load as mx_load
    from mlx.core import save_safetensors

    stripped = tmp_path / "stripped"
    shutil.copytree(target, stripped)
    weights = {k: v for k, v in mx_load(str(stripped / "model.safetensors")).items() if not k.startswith("mtp.")}
    save_safetensors(str(stripped / "model.safetensors"), weights)
    caps = capability.with_drafter(capability.detect(stripped, config), stripped, None, config)
    assert not caps.native_mtp_heads and not caps.mtp_capable and caps.drafter_reason == "not_mtp_capable"
    assert json.loads((stripped / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    # Booked as the head alone (its tensors and activations), and its own K/V per token per row.
    need = drafter_footprint(target, config, SpecMode.MTP, 3, 512)
    head_bytes = sum(v.nbytes for k, v in mx_load(str(target / "model.safetensors")).items() if k.startswith("mtp."))
    assert head_bytes < need < 4 * head_bytes + (64 << 20)
    assert head_kv_shape(target, config).bytes_per_token_full == 2 * 2 * 16 * 4  # K and V, 2 heads x 16, fp32


def test_greedy_with_the_head_equals_plain_decoding_alone_and_eight_together(target):
    n = 24
    ps = prompts(target)
    truth = [plain(target, p, n) for p in ps]
    node = make_node({NAME: target}, max_concurrent_jobs=8, speculation="on", speculation_k=3)

    async def main():
        alone = [await collect(node, Job(f"a{i}", NAME, greedy(n), prompt_ids=tuple(p))) for i, p in enumerate(ps)]
        together = await asyncio.gather(*(collect(node, Job(f"t{i}", NAME, greedy(n), prompt_ids=tuple(p)))
                                          for i, p in enumerate(ps)))
        await node.stop()
        return alone, together

    alone, together = run(main())
    accepted = set()
    for kind, results in (("alone", alone), ("together", together)):
        for i, (ids, _, done, _) in enumerate(results):
            spec = done.telemetry.speculation
            assert (spec.mode.value, spec.reason) == ("mtp", "ok"), (kind, i, spec)
            assert ids == truth[i], f"{kind} job {i} ({len(ps[i])} prompt tokens)"
            accepted.add(spec.accepted)
    trained = [r[2].telemetry.speculation for r in alone[:4]]
    # The distilled prompts: the head's first draft is accepted most rounds (real acceptance, not a stand-in).
    assert sum(s.accepted for s in trained) / sum(s.rounds for s in trained) > 0.5
    assert together[0][2].telemetry.speculation.mean_batch > 2  # verified together with the others
    assert len(accepted) > 2


def test_the_head_computes_what_mlx_vlms_qwen3_5_mtp_drafter_computes_on_the_same_weights(target):
    """The head as loaded here (models.qwen3_5_mtp) against mlx-vlm's Qwen3_5MTPDraftModel, loaded by mlx-vlm's
    own split of the same checkpoint: the same parameters, and on the prompt's pairs then four draft steps the
    same hidden state and draft tokens bit for bit, and the same K/V: V bit for bit, K within 1e-6 (mlx-lm's layer
    rotates with mx.fast.rope, mlx-vlm's with its own M-RoPE arithmetic: 2e-9 apart on one element here)."""
    pytest.importorskip("mlx_vlm.speculative.drafters.qwen3_5_mtp")
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.split import Qwen3_5MTPSplitter

    from provider.models.qwen3_5_mtp import load_head
    from provider.verification.hidden_tap import install

    theirs = Qwen3_5MTPSplitter().load(target)
    model, _ = load(str(target))
    tap = install(model)
    ours = load_head(target, model)
    mine, other = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
    assert mine.keys() == other.keys()
    assert [k for k in mine if not mx.array_equal(mine[k], other[k]).item()] == []

    ids = mx.array([train_prompts()[0] + prompts(target)[-1][:20]])
    model(ids)
    hidden, bonus = tap.last, 77
    theirs.reset(model)
    theirs.prefill_from_target_hidden(ids, hidden, bonus, None, greedy=True)
    lm = model.language_model
    cache = ours.make_cache()
    h = ours(lm.model.embed_tokens(mx.concatenate([ids[:, 1:], mx.array([[bonus]])], axis=1)), hidden, cache)[:, -1:]
    assert mx.array_equal(h, theirs._seed_hidden).item()
    drafted = []
    for step in range(4):
        token = lm.lm_head(h).argmax(-1)
        drafted.append(token.item())
        if step < 3:  # the fourth draft needs no step after it
            h = ours(lm.model.embed_tokens(token), h, cache)
    assert theirs.draft_block(bonus, hidden[:, -1:], None, 5, None, greedy=True).tolist() == [drafted]
    for a, b in zip(cache, theirs._cache):
        assert a.offset == b.offset
        assert mx.allclose(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :], rtol=1e-6, atol=1e-6).item()
        assert mx.array_equal(a.values[..., :a.offset, :], b.values[..., :b.offset, :]).item()


def _sampled(model, head, prompt, params, n, k, choice=SampledChoice, seed0=0, positions=6):
    """n speculative samples of the first `positions` tokens (seeds seed0, seed0 + 1, ...): rows of the engine's
    round loop with the head, 400 at a time, each reading the prompt itself as a fresh job does (the harness's
    rows start from one read prompt, which leaves a head no prompt pairs and accepts a fifth as often)."""
    spec, total, out = Speculator(model, HeadDrafter(head, Target(model))), SpecTelemetry("sampled", k=k), []
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


def test_sampled_rounds_with_the_head_are_distributed_as_plain_sampling(target):
    """test_spec_sampling's distribution test with the head: the first 6 tokens at T = 0.15 with top_p and top_k,
    k = 3, 800 samples a side; a chi-square per position does not tell speculative sampling from the node's plain
    sampler, and it does tell the biased control (every draft accepted). A low temperature keeps the samples near
    the continuations the head was distilled on, so a fifth of its drafts are accepted and the rest resampled."""
    model, _ = load(str(target))
    install(model)
    head = load_head(target, model)
    prompt = train_prompts()[0]
    params = SamplingParams(max_tokens=6, temperature=0.15, top_p=0.95, top_k=32, seed=3)
    plain = plain_samples(model, prompt, params, 800, 6)
    spec, stats = _sampled(model, head, prompt, params, 800, 3)
    assert stats.accepted > 200 and stats.judged - stats.accepted > 200, stats  # both branches, many times
    rows = compare(plain, spec, 6)
    assert all(r["p"] >= 1e-3 for r in rows), rows
    biased, _ = _sampled(model, head, prompt, params, 200, 2, choice=AcceptEveryDraft, seed0=10**6)
    assert min(r["p"] for r in compare(plain, biased, 6)) < 1e-3  # the test has the power to see a bias
