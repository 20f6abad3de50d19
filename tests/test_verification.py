"""Work the network can check (provider.verification): honest outcomes pass on every engine path they take, and
cheats are caught where they start, on real checkpoints the fixture factory builds and the node serves."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Proof
from tools.fixtures import cheats as cheat_fixtures
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
from provider.proofs.commitment import (CHUNK, HEADER, TOP_K, CommitmentBuilder, CommitmentError, decode,
                                              encode_chunk)
from provider.proofs.field import PRIME, evaluate, injective_modulus, interpolate
from provider.verification.verifier import Claim, ClaimReader, Verdict
from tests.helpers import collect, make_node, run

PROMPTS = [(1, 5, 9, 13, 17), (1, 40, 41, 42), (1, 100, 7, 300, 12, 9, 33), tuple(range(1, 90))]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)
SEEDED = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=11)


def check(node, model: str, prompt, ids, sampling: SamplingParams, proof: Proof, step: int = 64) -> Verdict:
    run(node.preload(model))
    lm = node.models.acquire(model)
    try:
        reader = ClaimReader(lm, Claim(tuple(prompt), tuple(ids), sampling, proof))
        while not reader.done:
            reader.step(step)
        return reader.verdict()
    finally:
        node.models.release(model)


async def generate(node, model: str, prompt, sampling: SamplingParams, job_id: str, **kw):
    ids, _, end, _ = await collect(node, Job(id=job_id, model=model, prompt_ids=tuple(prompt), sampling=sampling, **kw))
    assert isinstance(end, Done), end
    assert end.proof is not None and end.proof.commitment is not None
    return ids, end.proof


def test_the_field_interpolates_and_evaluates_back_and_keeps_wide_indices_distinct():
    rng = np.random.default_rng(0)
    xs = rng.choice(PRIME - 1, 128, replace=False)
    ys = rng.integers(0, PRIME, 128)
    assert (evaluate(interpolate(xs, ys), xs) == ys).all()
    wide = (np.arange(32)[:, None] * 8192 + rng.integers(0, 8192, (32, 4))).reshape(-1)  # past the field
    m = injective_modulus(wide)
    assert m <= PRIME and len(np.unique(wide % m)) == len(wide)


def test_a_commitment_is_eight_bytes_a_token_keeps_only_emitted_tokens_and_refuses_foreign_bytes():
    rng = np.random.default_rng(1)
    idx = np.stack([rng.permutation(64)[:TOP_K] for _ in range(70)])  # a token's entries are distinct
    bits = rng.integers(0, 0x7C00, (70, TOP_K)).astype(np.uint16)
    builder = CommitmentBuilder(64)
    for i in range(70):  # as the engine feeds it: a row per produced token, the last ones never emitted
        builder.add(idx[i:i + 1], bits[i:i + 1])
    data = builder.finish(65)
    assert data[:4] == HEADER and (len(data) - 4) / 65 < 8.2
    assert [m for m, _ in decode(data, 65)] and len(decode(data, 65)) == 3
    assert data[4:] == b"".join(encode_chunk(idx[i:i + CHUNK][:65 - i], bits[i:i + CHUNK][:65 - i], 64)
                                for i in range(0, 65, CHUNK))
    assert builder.finish(71) is None  # fewer rows than tokens: no commitment, never a short one
    for bad, tokens in [(data, 64), (data[:-1], 65), (b"X" + data[1:], 65), (data[:4] + b"\xff" * (len(data) - 4), 65)]:
        with pytest.raises(CommitmentError):
            decode(bad, tokens)


def test_honest_outcomes_pass_alone_and_in_a_mixed_batch_with_prefix_hits_and_small_chunks(fixtures_dir):
    samplings = [GREEDY, SEEDED, SamplingParams(max_tokens=40, temperature=1.2, top_k=20),
                 SamplingParams(max_tokens=33, temperature=0.3, min_p=0.05, seed=3),
                 SamplingParams(max_tokens=64, temperature=1.0),  # unseeded: the node draws a seed and says it
                 SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, logprobs=2),
                 SamplingParams(max_tokens=31, temperature=0.7, presence_penalty=0.5, logit_bias=((7, 3.0),), seed=5),
                 SamplingParams(max_tokens=1, temperature=0.0)]
    node = make_node({"m": fixtures_dir / "gemma4-tiny"}, commitments="on", speculation="off",
                     prefill_step_size=64)

    async def main():
        alone = [await generate(node, "m", PROMPTS[3], GREEDY, "alone")]
        batch = await asyncio.gather(*(generate(node, "m", PROMPTS[i % 4], s, f"b{i}")
                                       for i, s in enumerate(samplings)))
        again = [await generate(node, "m", PROMPTS[3], GREEDY, "again")]  # its prompt from the prefix cache
        return alone + batch + again

    outs = run(main())
    cases = [(PROMPTS[3], GREEDY)] + [(PROMPTS[i % 4], s) for i, s in enumerate(samplings)] + [(PROMPTS[3], GREEDY)]
    assert outs[0][0] == outs[-1][0]
    for (prompt, sampling), (ids, proof) in zip(cases, outs):
        assert proof.sampler == ("greedy" if sampling.greedy else "replayable")
        assert proof.seed == (None if sampling.greedy else sampling.seed if sampling.seed is not None else proof.seed)
        for step in (7, 512):  # the verifier's own chunking does not change its verdict
            verdict = check(node, "m", prompt, ids, sampling, proof, step)
            assert verdict.passed, verdict.summary()
    run(node.stop())


@pytest.mark.parametrize("pair", ["mtp", "draft"])
def test_speculating_nodes_pass_and_seeded_speculation_gives_plain_sampling_tokens(fixtures_dir, demo_f32, pair):
    target, drafter = (demo_f32 if pair == "mtp"  # the bundled pair in float32 (conftest's demo_f32)
                       else (fixtures_dir / "llama-tiny", fixtures_dir / "llama-tiny-draft"))
    spec = make_node({"m": target}, commitments="on", speculation="on", speculation_k=3,
                     manager_kw={"drafters": {"m": drafter}})
    plain = make_node({"m": target}, commitments="on", speculation="off")
    unseeded = SamplingParams(max_tokens=48, temperature=0.9, top_p=0.9)

    async def main(node):
        return await asyncio.gather(*(generate(node, "m", p, s, f"{i}-{j}") for i, p in enumerate(PROMPTS[:3])
                                      for j, s in enumerate([GREEDY, SEEDED, unseeded])))

    spec_outs, plain_outs = run(main(spec)), run(main(plain))
    cases = [(p, s) for p in PROMPTS[:3] for s in (GREEDY, SEEDED, unseeded)]
    for (prompt, sampling), (ids, proof), (plain_ids, _) in zip(cases, spec_outs, plain_outs):
        if sampling.seed is not None or sampling.greedy:
            assert ids == plain_ids  # coupled draws: the seed gives the same tokens speculating or not
        else:
            assert proof.sampler == "speculative"  # nobody can replay its draws: checked for plausibility
        verdict = check(spec, "m", prompt, ids, sampling, proof)
        assert verdict.passed, verdict.summary()
    run(spec.stop())
    run(plain.stop())


@pytest.fixture(scope="module")
def cheats(fixtures_dir, tmp_path_factory):
    root, src = tmp_path_factory.mktemp("cheats"), fixtures_dir / "gemma4-tiny"
    return {"noisy": cheat_fixtures.noisy(src, root / "noisy", 0.01),
            "q8": cheat_fixtures.quantized(src, root / "q8", 8),
            "q4": cheat_fixtures.quantized(src, root / "q4", 4),
            "dropped": cheat_fixtures.layer_dropped(src, root / "dropped", 1)}


def test_other_weights_served_under_the_models_name_are_caught(fixtures_dir, cheats):
    node = make_node({"m": fixtures_dir / "gemma4-tiny", **cheats}, commitments="on", speculation="off",
                     manager_kw={"max_resident": 8})

    async def main():
        return {name: [await generate(node, name, p, s, f"{name}-{i}-{s.temperature}")
                       for i, p in enumerate(PROMPTS[:2]) for s in (GREEDY, SEEDED)] for name in cheats}

    for name, outs in run(main()).items():
        for (prompt, sampling), (ids, proof) in zip([(p, s) for p in PROMPTS[:2] for s in (GREEDY, SEEDED)], outs):
            verdict = check(node, "m", prompt, ids, sampling, proof)
            assert not verdict.passed and verdict.first_failure == 0, (name, verdict.summary())
    run(node.stop())


def test_weights_one_percent_off_are_caught_where_most_values_stay_within_rel_tol(fixtures_dir, tmp_path):
    """On llama-tiny, weights 1% off move most committed values by less than rel_tol (chunks keep >= 90% of their
    points): the matched points' mean error is what catches them, at token 0."""
    noisy = cheat_fixtures.noisy(fixtures_dir / "llama-tiny", tmp_path / "noisy", 0.01)
    node = make_node({"m": fixtures_dir / "llama-tiny", "noisy": noisy}, commitments="on", speculation="off")
    cases = [(p, s) for p in PROMPTS for s in (GREEDY, SEEDED)]

    async def made():
        return await asyncio.gather(*(generate(node, "noisy", p, s, f"n{i}") for i, (p, s) in enumerate(cases)))

    outs = run(made())
    verdicts = [check(node, "m", p, ids, s, proof) for (p, s), (ids, proof) in zip(cases, outs)]
    assert all(not v.passed and v.first_failure == 0 for v in verdicts), [v.summary() for v in verdicts]
    # Overlap alone would have let some through: the chunks over it that fail on their mean error.
    assert any(c.overlap >= 0.9 for v in verdicts for c in v.chunks), [v.summary()["min_overlap"] for v in verdicts]
    assert all(c.mean_rel_err > 0.003 for v in verdicts for c in v.chunks if c.overlap >= 0.9)
    run(node.stop())


def test_lies_about_the_prompt_sampling_seed_or_drafter_and_splices_are_caught_where_they_start(fixtures_dir, cheats):
    node = make_node({"m": fixtures_dir / "gemma4-tiny", "noisy": cheats["noisy"],
                      "draft": fixtures_dir / "llama-tiny-draft", "llama": fixtures_dir / "llama-tiny"},
                     commitments="on", speculation="off", manager_kw={"max_resident": 8})
    hot = dataclasses.replace(SEEDED, temperature=1.3)
    long = SamplingParams(max_tokens=64, temperature=0.0)
    prompt = PROMPTS[0]

    async def main():
        out = {"hot": await generate(node, "m", prompt, hot, "hot"),
               "seeded": await generate(node, "m", prompt, SEEDED, "seeded"),
               "reseeded": await generate(node, "m", prompt, dataclasses.replace(SEEDED, seed=12), "reseeded"),
               "other_prompt": await generate(node, "m", (1, 2, 3) + prompt[1:], GREEDY, "other-prompt"),
               "drafter_alone": await generate(node, "draft", prompt, GREEDY, "drafter-alone"),
               "honest": await generate(node, "m", prompt, long, "honest")}
        head = out["honest"][0][:CHUNK]
        out["tail"] = await generate(node, "noisy", prompt + tuple(head), dataclasses.replace(long, max_tokens=32), "tail")
        return out

    out = run(main())
    verdicts = {
        "hot": check(node, "m", prompt, *out["hot"][:1], SEEDED, out["hot"][1]),
        "reseeded": check(node, "m", prompt, out["reseeded"][0], SEEDED, dataclasses.replace(out["reseeded"][1], seed=11)),
        "other_prompt": check(node, "m", prompt, out["other_prompt"][0], GREEDY, out["other_prompt"][1]),
        "drafter_alone": check(node, "llama", prompt, out["drafter_alone"][0], GREEDY, out["drafter_alone"][1]),
    }
    for name, verdict in verdicts.items():
        assert not verdict.passed, (name, verdict.summary())
    # The same seed at another temperature: the same tokens until the first the temperature changes.
    first_change = next(j for j, (a, b) in enumerate(zip(out["hot"][0], out["seeded"][0])) if a != b)
    assert verdicts["hot"].first_failure == first_change and verdicts["hot"].chunks[0].overlap == 1.0
    assert verdicts["reseeded"].first_failure == 0
    # A splice: 32 honest tokens, then another model's, each with its own commitment, chunk by chunk.
    (head, honest), (tail, spliced) = out["honest"], out["tail"]
    commitment = honest.commitment[:len(HEADER) + 2 + 2 * TOP_K * CHUNK] + spliced.commitment[len(HEADER):]
    verdict = check(node, "m", prompt, head[:CHUNK] + tail, long, dataclasses.replace(honest, commitment=commitment))
    assert not verdict.passed and verdict.first_failure == CHUNK, verdict.summary()
    assert verdict.chunks[0].overlap == 1.0
    run(node.stop())


def test_provider_verify_checks_a_saved_claim_offline_and_says_so_in_its_exit_code(fixtures_dir, cheats, tmp_path):
    import json
    import subprocess
    import sys

    from google.protobuf import json_format

    from coordinator_client import convert
    from coordinator_client.pb import provider_pb2 as pb
    from coordinator_client.spot_checks import SpotChecks

    node = make_node({"m": fixtures_dir / "gemma4-tiny", "noisy": cheats["noisy"]}, commitments="on",
                     speculation="off", manager_kw={"max_resident": 4})
    original = pb.JobRequest(job_id="j", model="m", max_tokens=24, sampling=pb.SamplingParams(temperature=0.7, seed=9),
                             chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hello there")]))
    job = convert.job_from_request(original, max_tokens_limit=4096, default_max_tokens=256)
    files = {}
    for name in ("m", "noisy"):
        ids, _, end, _ = run(collect(node, dataclasses.replace(job, id=name, model=name)))
        claim = SpotChecks(1.0).verify_request(original, ids, convert.proof_to_pb(end.proof))
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json_format.MessageToJson(claim))
    run(node.stop())
    (tmp_path / "garbage.json").write_text('{"verify": 3}')

    def verify(path):
        return subprocess.run([sys.executable, "-m", "provider", "verify", str(path), "--model",
                               str(fixtures_dir / "gemma4-tiny")], capture_output=True, text=True, timeout=300)

    honest, cheat, garbage = verify(files["m"]), verify(files["noisy"]), verify(tmp_path / "garbage.json")
    assert honest.returncode == 0 and json.loads(honest.stdout)["passed"], honest.stderr
    out = json.loads(cheat.stdout)
    assert cheat.returncode == 1 and not out["passed"] and out["first_failure"] == 0, cheat.stderr
    assert garbage.returncode == 65 and "not a JobRequest" in garbage.stderr


def test_commitments_stay_true_while_the_profiler_runs_the_same_model_on_its_own_thread():
    """Under auto with no kept profile, the pair serves plainly while its costs are measured on another thread,
    with forwards of the same model: each thread reads its own hidden states."""
    node = make_node({"m": DEMO_TARGET}, commitments="on", speculation="auto",
                     manager_kw={"drafters": {"m": DEMO_ASSISTANT}})

    async def main():
        await node.preload("m")
        assert node.models.acquire("m").profile_pending  # measuring now
        node.models.release("m")
        return await asyncio.gather(*(generate(node, "m", PROMPTS[i % 4], s, f"p{i}")
                                      for i, s in enumerate([GREEDY, SEEDED] * 4)))

    outs = run(main())
    for i, (ids, proof) in enumerate(outs):
        verdict = check(node, "m", PROMPTS[i % 4], ids, [GREEDY, SEEDED][i % 2], proof)
        assert verdict.passed, verdict.summary()
    run(node.stop())


def test_a_verify_job_is_booked_cancelled_and_ended_once_like_any_job(fixtures_dir, monkeypatch):
    from provider.engine.verify_reads import VerifyReads
    from provider.jobs import Claim as Claimed
    from provider.outputs import Error
    from tests.helpers import until

    node = make_node({"m": fixtures_dir / "gemma4-tiny"}, commitments="on", speculation="off")
    held = []
    real_step = VerifyReads.step
    monkeypatch.setattr(VerifyReads, "step", lambda self, budget, **kw: [] if held else real_step(self, budget, **kw))

    async def main():
        ids, proof = await generate(node, "m", PROMPTS[3], GREEDY, "made")
        claim = Claimed(tuple(ids), proof)
        held.append(True)
        events = []
        async with node.run(Job(id="v", model="m", prompt_ids=PROMPTS[3], sampling=GREEDY, verify=claim)) as stream:
            await until(lambda: node.status().active_jobs == 1, "the verify job running")
            assert node.status().memory.jobs_kv_bytes > 0  # its read is booked as a scored prompt
            node.cancel("v")
            async for ev in stream:
                events.append(ev)
        held.clear()
        # The original request's speculation="on" travels in a spot check's copy of it: this verifier has no
        # drafter, and a verify job makes no tokens, so it is not refused for that.
        again = await collect(node, Job(id="v2", model="m", prompt_ids=PROMPTS[3], sampling=GREEDY, verify=claim,
                                        speculation="on"))
        bad = await collect(node, Job(id="v3", model="m", prompt_ids=PROMPTS[3], sampling=GREEDY,
                                      verify=Claimed((10**6,), proof)))
        return events, again, bad

    events, again, bad = run(main())
    assert [type(e).__name__ for e in events if isinstance(e, (Done, Error))] == ["Done"]
    assert events[-1].finish_reason.value == "cancelled" and events[-1].verdict is None
    assert again[2].verdict.passed and again[0] == []  # a verify job makes no tokens
    assert isinstance(bad[2], Error) and bad[2].cause.value == "invalid_request"  # outside the vocabulary
    run(node.stop())


def test_a_local_node_that_commits_returns_proofs_that_provider_verify_accepts(fixtures_dir, tmp_path):
    import json
    import subprocess
    import sys

    import openai

    from tests.helpers import LocalServer

    model = fixtures_dir / "gemma4-tiny"
    server = LocalServer(model, tmp_path, "--no-auth", env={"PROVIDER_COMMITMENTS": "on"})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        messages = [{"role": "user", "content": "Hello there"}]
        kw = dict(model="gemma4-tiny", messages=messages, max_tokens=20, temperature=0.7, seed=3)
        whole = client.chat.completions.create(**kw).choices[0].model_extra["proof"]
        streamed = [c.model_extra.get("proof") for c in client.chat.completions.create(stream=True, **kw)]
        streamed = next(p for p in streamed if p)
    finally:
        server.stop()
    assert whole == streamed and whole["sampler"] == "replayable" and whole["seed"] == 3
    ended = {"endToken": whole["end_token"]} if whole["end_token"] is not None else {}  # it ended on EOS
    claim = {"model": "gemma4-tiny", "chat": {"messages": messages}, "maxTokens": 20,
             "sampling": {"temperature": 0.7, "seed": "3"},
             "verify": {"outputIds": whole["output_ids"],
                        "proof": {"commitment": whole["commitment"], "sampler": "PROOF_SAMPLER_REPLAYABLE",
                                  "seed": "3"} | ended}}
    (tmp_path / "claim.json").write_text(json.dumps(claim))
    r = subprocess.run([sys.executable, "-m", "provider", "verify", str(tmp_path / "claim.json"), "--model", str(model)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["passed"], r.stdout + r.stderr
