"""Speculative decoding is lossless, memory-gated, and reports what it did."""

import itertools
import random
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from provider import speculation as sp
from provider.engine.proposers import DraftModelDrafter
from provider.engine.spec_rounds import speculative_tokens
from provider.telemetry import SpecTelemetry
from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Error
from provider.types import Cause
from tests.helpers import collect, greedy, make_node, run, until

TEXT = "The quick brown fox jumps over the lazy dog. Café 日本語 🙂 def trim(self, n): return n. " * 6


def prompts(tok, count: int) -> list[list[int]]:
    """Prompts from 2 tokens to well past the 32-token sliding window."""
    ids = tok.encode(TEXT)
    lengths = [2, 5, 9, 17, 24, 30, 31, 32, 33, 34, 40, 47, 55, 63, 64, 65, 70, 80, 96, 110, 120, 127][:count]
    return [ids[i:i + n] for i, n in zip(range(0, 7 * len(lengths), 7), lengths)]


def plain_greedy(model, prompt, n):
    return [t for t, _ in itertools.islice(generate_step(mx.array(prompt), model, max_tokens=n), n)]


@pytest.fixture(scope="module")
def perturbed_draft(fixtures_dir, tmp_path_factory):
    """A draft model that agrees with llama-tiny often but not always: its weights plus a little noise."""
    out = tmp_path_factory.mktemp("drafts") / "llama-tiny-perturbed"
    shutil.copytree(fixtures_dir / "llama-tiny", out)
    weights = mx.load(str(out / "model.safetensors"))
    rng = np.random.default_rng(0)
    noisy = {k: v + mx.array(rng.normal(0, 0.02, v.shape).astype(np.float32)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), noisy)
    return out


class OracleMixDrafter:
    """Test-only drafter (named as such): proposes the known greedy continuation with chosen positions
    corrupted, so every acceptance length 0..k occurs against a real target and its real caches."""

    mode = "oracle"

    def __init__(self, truth: list[int], vocab: int, seed: int):
        self.truth, self.vocab, self.rng, self.pos = truth, vocab, random.Random(seed), 1

    def begin(self, row):
        pass

    def read(self, row, tokens):
        pass

    def start(self, row, first):
        pass

    def propose(self, rows, k, caches):
        out = []
        for i in range(k):
            t = self.truth[self.pos + i] if self.pos + i < len(self.truth) else 0
            out.append((t + 1) % self.vocab if self.rng.random() < 0.3 else t)
        return mx.array([out]), [[None] * k]

    def accepted(self, row, n, k, drafts, bonus):
        self.pos += n + 1


@pytest.mark.parametrize("family", ["gemma4-tiny", "llama-tiny"])
def test_partial_acceptance_and_rollback_are_lossless(fixtures_dir, family):
    model, tok = load(str(fixtures_dir / family))
    checked = 0
    for prompt in prompts(tok, 22)[::2]:  # 2 to 120 tokens: either side of the 32-token window, and of 64
        truth = plain_greedy(model, prompt, 48)
        for k in (1, 3, 12):
            stats = SpecTelemetry("oracle", k=k)
            drafter = OracleMixDrafter(truth, model.args.vocab_size if hasattr(model.args, "vocab_size") else 512,
                                       seed=k * 1000 + len(prompt))
            out = list(itertools.islice(speculative_tokens(model, prompt, drafter, k=k, stats=stats), 48))
            assert out == truth, f"{family} prompt of {len(prompt)} tokens, k={k}"
            assert 0 < stats.accepted < stats.drafted  # both acceptances and rejections happened
            checked += 1
    assert checked == 11 * 3


def test_draft_model_speculation_is_lossless(fixtures_dir, perturbed_draft):
    model, tok = load(str(fixtures_dir / "llama-tiny"))
    for draft_path in (perturbed_draft, fixtures_dir / "llama-tiny"):
        draft, _ = load(str(draft_path))
        for prompt in prompts(tok, 20)[::2]:
            truth = plain_greedy(model, prompt, 40)
            stats = SpecTelemetry("draft", k=3)
            out = list(itertools.islice(speculative_tokens(model, prompt, DraftModelDrafter(draft), k=3,
                                                           stats=stats), 40))
            assert out == truth, (draft_path.name, len(prompt))
        if draft_path.name == "llama-tiny":  # the target drafting for itself is always right
            assert stats.accepted == stats.drafted


def _node(fixtures_dir, drafters, **kw):
    models = {"gemma": fixtures_dir / "gemma4-tiny", "llama": fixtures_dir / "llama-tiny",
              "qwen": fixtures_dir / "qwen3-tiny"}
    return make_node(models, manager_kw={"drafters": drafters, "kv_reserve_tokens": 256, "prefill_step": 64}
                     | kw.pop("manager_kw", {}), **kw)


def test_through_the_node_mtp_and_draft_equal_plain_and_telemetry_adds_up(fixtures_dir, perturbed_draft):
    node = _node(fixtures_dir, {"gemma": fixtures_dir / "gemma4-tiny-assistant", "llama": perturbed_draft},
                 max_concurrent_jobs=2, speculation="on")  # the fixtures' drafters do not pay: auto would not use them
    _, tok = load(str(fixtures_dir / "llama-tiny"))
    texts = [tok.decode(p) for p in prompts(tok, 20)[::2]]

    async def main():
        for model, mode in (("gemma", "mtp"), ("llama", "draft")):
            for i, text in enumerate(texts):
                job = Job(f"{model}-{i}", model, greedy(32), prompt=text)
                off = Job(f"{model}-{i}-off", model, greedy(32), prompt=text, speculation="off")
                spec_ids, _, spec, _ = await collect(node, job)
                plain_ids, _, plain, _ = await collect(node, off)
                assert spec_ids == plain_ids, (model, i)
                s = spec.telemetry.speculation.as_dict()
                assert s["mode"] == mode and s["reason"] == "ok" and s["k"] == 3
                assert s["accepted"] <= s["drafted"] == 3 * s["rounds"]
                if spec.finish_reason == "length" and spec.usage.completion_tokens == s["accepted"] + s["target_forwards"]:
                    assert s["tokens_per_target_forward"] == round(
                        spec.usage.completion_tokens / s["target_forwards"], 4)
                assert plain.telemetry.speculation.as_dict() == {"mode": "off", "reason": "policy_off"}
        await node.stop()

    run(main())


def test_emitted_equals_accepted_plus_target_forwards_when_nothing_is_cut(fixtures_dir):
    # The target as its own drafter accepts everything: whole rounds only, no cut when max_tokens fits.
    node = _node(fixtures_dir, {"llama": fixtures_dir / "llama-tiny"}, speculation="on")

    async def main():
        _, _, done, _ = await collect(node, Job("a", "llama", greedy(1 + 4 * 5), prompt="hello there"))
        s = done.telemetry.speculation.as_dict()
        assert done.usage.completion_tokens == 21 == s["accepted"] + s["target_forwards"]
        assert s["target_forwards"] == 6 and s["tokens_per_target_forward"] == 3.5 and s["acceptance_rate"] == 1.0
        await node.stop()

    run(main())


def test_eos_and_max_tokens_cut_speculative_output_like_plain(fixtures_dir, perturbed_draft):
    node = _node(fixtures_dir, {"llama": perturbed_draft, "gemma": fixtures_dir / "gemma4-tiny-assistant"},
                 speculation="on")

    async def main():
        for model in ("llama", "gemma"):
            ids, _, ref, _ = await collect(node, Job("ref", model, greedy(30), prompt="The cache", speculation="off"))
            full = await collect(node, Job("s", model, greedy(30), prompt="The cache"))
            assert full[0] == ids and full[2].finish_reason == ref.finish_reason  # a natural EOS cuts alike
            for n in (1, 2, 5, min(13, len(ids))):
                a = await collect(node, Job("s", model, greedy(n), prompt="The cache"))
                assert a[0] == ids[:n] and a[2].finish_reason == "length"
            stop_id = ids[len(ids) // 2]  # an EOS in the middle of a speculative round
            a = await collect(node, Job("s", model, greedy(30, stop_token_ids=(stop_id,)), prompt="The cache"))
            assert a[0] == ids[: ids.index(stop_id)] and a[2].finish_reason == "stop"
        await node.stop()

    run(main())


def test_reasons_when_speculation_is_off(fixtures_dir):
    node = _node(fixtures_dir, {"gemma": fixtures_dir / "gemma4-tiny-assistant"})

    async def main():
        cases = [
            (Job("q", "qwen", greedy(3), prompt="x"), "not_mtp_capable"),
            (Job("l", "llama", greedy(3), prompt="x"), "not_mtp_capable"),
            (Job("t", "gemma", SamplingParams(max_tokens=3, temperature=0.7, logit_bias=((5, 1.0),)), prompt="x"),
             "ineligible_request:logits_processors"),
            (Job("o", "gemma", greedy(3), prompt="x", speculation="off"), "policy_off"),
        ]
        for job, reason in cases:
            done = (await collect(node, job))[2]
            assert done.telemetry.speculation.as_dict() == {"mode": "off", "reason": reason}
        # `on` that cannot be honoured fails loudly with the reason.
        err = (await collect(node, Job("on", "qwen", greedy(3), prompt="x", speculation="on")))[2]
        assert isinstance(err, Error) and err.cause == Cause.SPECULATION_UNAVAILABLE and "not_mtp_capable" in err.message
        ok = (await collect(node, Job("on2", "gemma", greedy(3), prompt="x", speculation="on")))[2]
        assert ok.telemetry.speculation.mode == "mtp"
        await node.stop()

    run(main())


def test_a_gemma4_without_an_assistant_says_no_drafter(fixtures_dir):
    node = _node(fixtures_dir, {})

    async def main():
        done = (await collect(node, Job("g", "gemma", greedy(3), prompt="x")))[2]
        assert done.telemetry.speculation.as_dict() == {"mode": "off", "reason": "no_drafter"}
        await node.stop()

    run(main())


def test_node_policy_off_never_loads_a_drafter(fixtures_dir):
    node = _node(fixtures_dir, {"gemma": fixtures_dir / "gemma4-tiny-assistant"}, speculation="off")

    async def main():
        done = (await collect(node, Job("g", "gemma", greedy(3), prompt="x")))[2]
        assert done.telemetry.speculation.reason == "policy_off"
        assert node.status().models[0].bytes > 0 and node.models._entries["gemma"].drafter_bytes == 0
        await node.stop()

    run(main())


def test_serving_qwen3_never_reads_drafter_weights(fixtures_dir, monkeypatch):
    opened: list[str] = []
    real_load = mx.load
    monkeypatch.setattr(mx, "load", lambda path, *a, **k: opened.append(str(path)) or real_load(path, *a, **k))
    # An assistant is configured for qwen3 by mistake: its config does not pair, so no weights are read.
    node = _node(fixtures_dir, {"qwen": fixtures_dir / "gemma4-tiny-assistant"})

    async def main():
        done = (await collect(node, Job("q", "qwen", greedy(4), prompt="x")))[2]
        assert isinstance(done, Done) and done.telemetry.speculation.mode == "off"
        await node.stop()

    run(main())
    assert opened and not any("assistant" in p for p in opened), opened


def test_budget_too_small_for_the_drafter_serves_the_target_alone(fixtures_dir):
    from provider.drafters import registry
    from provider.memory.checkpoint import read_config
    from provider.models.footprint import estimate_footprint

    target = estimate_footprint(fixtures_dir / "gemma4-tiny", read_config(fixtures_dir / "gemma4-tiny"),
                                kv_tokens=256, prefill_step=64).total
    assistant = fixtures_dir / "gemma4-tiny-assistant"
    config = read_config(assistant)
    drafter = registry.kind_of(fixtures_dir / "gemma4-tiny", assistant, config).footprint(assistant, config, 3, 64)
    # Room for the target and its job, half the drafter's: not a few KiB over, which whatever else this test
    # process's MLX holds (a worker's earlier tests) could take.
    node = make_node({"gemma": fixtures_dir / "gemma4-tiny"}, budget_bytes=target + drafter // 2,
                     manager_kw={"drafters": {"gemma": fixtures_dir / "gemma4-tiny-assistant"},
                                 "kv_reserve_tokens": 256, "prefill_step": 64})

    async def main():
        done = (await collect(node, Job("g", "gemma", greedy(4), prompt="x")))[2]
        assert isinstance(done, Done)
        assert done.telemetry.speculation.as_dict() == {"mode": "off", "reason": "insufficient_headroom"}
        await node.stop()

    run(main())


def test_the_drafter_is_freed_with_its_target(fixtures_dir):
    node = _node(fixtures_dir, {"gemma": fixtures_dir / "gemma4-tiny-assistant"}, manager_kw={"max_resident": 1})

    async def main():
        await collect(node, Job("g", "gemma", greedy(3), prompt="x"))
        entry = node.models._entries["gemma"]
        assert entry.drafter_bytes > 0 and entry.lm.drafter is not None
        await collect(node, Job("q", "qwen", greedy(3), prompt="x"))  # evicts gemma and its drafter
        assert node.models.resident() == ["qwen"] and "gemma" not in node.models._entries
        await node.stop()

    run(main())


def test_plan_is_a_pure_decision():
    g, s = greedy(4), SamplingParams(max_tokens=4, temperature=0.5)
    assert sp.plan(policy="auto", drafter_mode="mtp", drafter_reason="ok", sampling=g, k=3) == sp.SpecPlan("mtp", "ok", 3)
    assert sp.plan(policy="off", drafter_mode="mtp", drafter_reason="ok", sampling=g, k=3).reason == "policy_off"
    assert sp.plan(policy="auto", drafter_mode=None, drafter_reason="insufficient_headroom", sampling=g,
                   k=3).reason == "insufficient_headroom"
    assert sp.plan(policy="on", drafter_mode="draft", drafter_reason="ok", sampling=s, k=3) == sp.SpecPlan("draft", "ok", 3)
    biased = SamplingParams(max_tokens=4, temperature=0.5, presence_penalty=0.5)
    assert sp.plan(policy="on", drafter_mode="draft", drafter_reason="ok", sampling=biased,
                   k=3).reason == "ineligible_request:logits_processors"
    assert sp.effective_policy("off", "auto") == "off" and sp.effective_policy("auto", "off") == "off"
    assert sp.effective_policy("auto", "on") == "on"


SPEC_FIELDS = {"mode", "reason", "k", "rounds", "drafted", "accepted", "acceptance_rate", "target_forwards",
               "tokens_per_target_forward", "draft_ms", "verify_ms"}


def _consistent(spec: dict, completion_tokens: int, finish_reason: str) -> None:
    """Self-drafting with max_tokens = 1 + rounds * (k + 1): nothing is cut unless an EOS ends the job."""
    assert SPEC_FIELDS <= spec.keys() and spec["mode"] == "draft" and spec["reason"] == "ok"
    assert spec["accepted"] <= spec["drafted"]
    if finish_reason == "length":
        assert completion_tokens == spec["accepted"] + spec["target_forwards"]
        assert spec["tokens_per_target_forward"] == round(completion_tokens / spec["target_forwards"], 4)
    else:  # an EOS inside a round: tokens after it were accepted but not emitted
        assert completion_tokens < spec["accepted"] + spec["target_forwards"]


def test_speculation_telemetry_through_the_local_api(fixtures_dir, tmp_path):
    import openai

    from tests.helpers import LocalServer

    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path, "--drafter", str(fixtures_dir / "llama-tiny"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.token, max_retries=0)
        # The target drafting for itself never pays (auto says not_profitable), so these ask for `on`.
        on = {"speculation": "on"}
        r = client.completions.create(model="llama-tiny", prompt="hello", max_tokens=13, temperature=0, extra_body=on)
        _consistent(r.model_extra["telemetry"]["speculation"], r.usage.completion_tokens, r.choices[0].finish_reason)
        stream = list(client.chat.completions.create(model="llama-tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=9, temperature=0, stream=True, extra_body=on))
        final = [c for c in stream if c.choices and c.choices[0].finish_reason][0]
        _consistent(final.model_extra["telemetry"]["speculation"], final.usage.completion_tokens,
                    final.choices[0].finish_reason)
        off = client.completions.create(model="llama-tiny", prompt="hello", max_tokens=5, temperature=0,
                                        extra_body={"speculation": "off"})
        assert off.model_extra["telemetry"]["speculation"] == {"mode": "off", "reason": "policy_off"}
    finally:
        assert srv.stop() == 0


def test_speculation_telemetry_through_the_grpc_path(fixtures_dir, tmp_path):
    from coordinator_client.pb import provider_pb2 as pb
    from tools.harness.nodes import harness, job

    async def main():
        models = {"llama": fixtures_dir / "llama-tiny"}
        async with harness(models, tmp_path, manager_kw={"drafters": {"llama": fixtures_dir / "llama-tiny"}}) as (
                coord, node, _):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("spec", "llama", max_tokens=13, speculation=pb.SPECULATION_POLICY_ON))
            done = (await coord.outcome("spec")).job_done
            spec = done.telemetry.speculation
            _consistent({f: getattr(spec, f) for f in SPEC_FIELDS}, done.usage.completion_tokens, done.finish_reason)
            assert spec.sampling_scheme == "greedy"
            coord.dispatch(s, job("sampled", "llama", max_tokens=8, temperature=0.7,
                                  speculation=pb.SPECULATION_POLICY_ON))
            sampled = (await coord.outcome("sampled")).job_done.telemetry.speculation
            assert sampled.mode == "draft" and sampled.sampling_scheme == "speculative_sampling"
            drafted, accepted = spec.drafted + sampled.drafted, spec.accepted + sampled.accepted

            def counted() -> tuple:
                c = s.heartbeats[-1].counters if s.heartbeats else None
                return c and (c.spec_drafted_tokens, c.spec_accepted_tokens)

            # A heartbeat after both outcomes counts both jobs' drafts (the deadline is what it says if none does).
            await until(lambda: counted() == (drafted, accepted),
                        lambda: f"heartbeat counters {counted()}, the jobs' {(drafted, accepted)}")

    run(main())


def test_provider_bench_writes_json_and_refuses_bad_arguments(fixtures_dir, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    base = [sys.executable, "-m", "provider", "bench", "--model", str(fixtures_dir / "gemma4-tiny"),
            "--drafter", str(fixtures_dir / "gemma4-tiny-assistant")]
    r = subprocess.run([*base, "--k", "1,3", "--prompts", "2", "--max-tokens", "8", "--out", str(out),
                        "--plot", str(tmp_path / "bench.png")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["model"]["sha256"] and data["drafter"]["mode"] == "mtp" and data["versions"]["mlx"]
    assert len(data["profile"]["round_ms"]) == 3 and data["profile"]["plain_token_ms"] > 0
    for runs in (data["greedy"], data["sampled"]["runs"]):
        assert [run_["config"] for run_ in runs] == ["off", "k=1", "k=3", "auto"]
        assert len(runs[0]["token_ids"]) == 2 and runs[1]["tokens_per_s"] > 0 and len(runs[-1]["k_chosen"]) == 2
    assert all(run_["identical_to_plain"] for run_ in data["greedy"][1:])
    assert data["sampled"]["temperature"] == 0.7 and "sample_and_compare" in data["sampled"]["runs"][1][
        "expected_acceptance"]
    assert "auto/off = " in r.stdout and "auto/best fixed" in r.stdout
    for bad in (["--k", "0"], ["--k", "abc"], ["--prompts", "0"]):
        r = subprocess.run([*base, *bad, "--out", str(out)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, bad


def test_logits_processors_run_plain_with_a_reason_and_are_honoured(fixtures_dir):
    node = _node(fixtures_dir, {"llama": fixtures_dir / "llama-tiny"})

    async def main():
        biased = greedy(8, logit_bias=((42, 100.0),))
        ids, _, done, _ = await collect(node, Job("b", "llama", biased, prompt="hello"))
        assert ids == [42] * 8  # the bias was applied
        assert done.telemetry.speculation.as_dict() == {"mode": "off", "reason": "ineligible_request:logits_processors"}
        pen = greedy(16, repetition_penalty=1.5)
        ids, _, done, _ = await collect(node, Job("r", "llama", pen, prompt="hello"))
        from mlx_lm.sample_utils import make_logits_processors

        model, tok = load(str(fixtures_dir / "llama-tiny"))
        expected = [t for t, _ in itertools.islice(generate_step(
            mx.array(tok.encode("hello")), model, max_tokens=16,
            logits_processors=make_logits_processors(repetition_penalty=1.5)), 16)]
        assert ids == expected
        await node.stop()

    run(main())


def test_the_trained_demo_pair_alone_is_lossless_across_its_window(demo_f32):
    """One row at a time (its own caches, no merge); tests/test_spec_batch.py has the pair in batches. The pair in
    float32 (conftest's demo_f32)."""
    from provider.engine.proposers import MTPDrafter
    from provider.models.gemma4_target import Target
    from provider.drafters.gemma4_assistant import load_assistant

    model, tok = load(str(demo_f32[0]))
    drafter = MTPDrafter(load_assistant(demo_f32[1]), Target(model))
    ids = tok.encode(TEXT * 3)
    total = accepted = drafted = 0
    for i, n in enumerate([3, 124, 127, 129, 131, 160]):
        prompt = ids[i * 5:i * 5 + n]  # the longest cross the 128-token window while prefilling, the rest while decoding
        truth = plain_greedy(model, prompt, 24)
        stats = SpecTelemetry("mtp", k=3)
        out = list(itertools.islice(speculative_tokens(model, prompt, drafter, k=3, stats=stats), 24))
        assert out == truth, f"prompt of {n} tokens"
        total, accepted, drafted = total + 1, accepted + stats.accepted, drafted + stats.drafted
    assert total == 6 and 0 < accepted < drafted  # a real drafter: accepts often, not always
