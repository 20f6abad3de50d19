"""Claims bound to their requests (issue 55): the verifier believes nothing the producer says about how it sampled.

The attacker holds the real weights, so it commits honestly to any token string (tools.harness.forger): only the
token and claim checks stand between its claim and a pass. It answers with a 4-bit copy's tokens, another seed's,
greedy tokens for a sampled job, a `speculative` label on greedy and seeded jobs, an overlong output, a made-up
end, an output cut short; every one fails, through a verify job and through `provider verify`, and never makes
the verifier raise. Honest greedy, seeded, coupled-MTP and unseeded-MTP outputs pass."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from coordinator_client import convert
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.spot_checks import SpotChecks
from provider.jobs import Claim, Job, SamplingParams
from provider.outputs import Done, Proof
from tools.fixtures import cheats as cheat_fixtures
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
from provider.proofs.verdicts import CPU, DIVERGENT_KERNELS, Tolerance, clamped, looser
from provider.proofs.commitment import CommitmentBuilder
from provider.verification.claim_rules import Failure, TokenCheck, length_failure, token_check
from provider.verification.verifier import allowed_ties, judge
from tests.helpers import collect, make_node, run
from tools.harness.forger import forged_commitment

PROMPT = (1, 100, 7, 300, 12, 9, 33)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
SEEDED = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11)
SEEDED_FULL = SamplingParams(max_tokens=32, temperature=0.8, seed=12)  # top_p 1.0: the API's default
UNSEEDED = SamplingParams(max_tokens=32, temperature=0.8)


# --- the rules, as pure functions -----------------------------------------------------------------------------

@pytest.mark.parametrize("sampling, proof, expected", [
    (GREEDY, Proof(b"c", "greedy"), TokenCheck("greedy")),
    (GREEDY, Proof(b"c", "speculative"), 0),
    (GREEDY, Proof(b"c", "replayable", seed=5), 0),
    (SEEDED, Proof(b"c", "replayable", seed=11), TokenCheck("replayable", 11)),
    (SEEDED, Proof(b"c", "replayable", seed=12), 0),  # another seed: ground, not the request's
    (SEEDED, Proof(b"c", "speculative"), 0),
    (SEEDED, Proof(b"c", "greedy"), 0),
    (UNSEEDED, Proof(b"c", "greedy"), 0),
    (UNSEEDED, Proof(b"c", "replayable", seed=77), TokenCheck("replayable", 77)),  # the seed the node drew
    (UNSEEDED, Proof(b"c", "speculative"), TokenCheck("speculative")),
])
def test_the_request_decides_the_check_and_a_contradicting_declaration_fails_at_token_0(sampling, proof, expected):
    got = token_check(sampling, proof)
    if expected == 0:
        assert isinstance(got, Failure) and got.position == 0 and got.reason, got
    else:
        assert got == expected


def test_length_and_ending_follow_from_the_request():
    ends = {2}
    assert length_failure([5] * 8, None, 8, ends, None) is None  # ran to max_tokens
    assert length_failure([5] * 7, 2, 8, ends, None) is None  # ended on an end token inside the limit
    assert length_failure([5] * 5, None, 8, ends, 4) is None  # a stop string completed by its last token
    assert length_failure([5] * 8, 2, 8, ends, None).position == 8  # the end token is past the limit
    assert length_failure([5] * 9, None, 8, ends, None).position == 8  # overlong
    assert length_failure([5] * 5, None, 8, ends, None).position == 5  # cut short, no reason to stop
    assert length_failure([5] * 5, None, 8, ends, 2).position == 3  # went on past its stop string
    assert length_failure([5] * 5, 2, 8, ends, 4).position == 5  # an end token after the stop had ended it
    assert length_failure([5, 2, 5], None, 3, ends, None).position == 1  # an end id inside the output


def test_ties_allowed_are_a_share_rounded_down_and_tolerances_only_tighten_past_the_loosest_profile():
    assert [allowed_ties(n, Tolerance()) for n in (1, 19, 20, 39, 40, 100)] == [0, 0, 1, 1, 2, 5]
    # Too many near-ties fail where the first of them is: where the output first left the model's choice.
    too_many = judge(4, [], np.array([0.0, 0.01, 0.0, 0.015]), "replayable", CPU)
    assert (too_many.passed, too_many.first_failure, too_many.ties) == (False, 1, 2), too_many
    both = looser(CPU, DIVERGENT_KERNELS)
    assert both.rel_tol == max(CPU.rel_tol, DIVERGENT_KERNELS.rel_tol)
    assert both.min_overlap == min(CPU.min_overlap, DIVERGENT_KERNELS.min_overlap)
    lax = clamped(Tolerance(rel_tol=10.0, min_overlap=0.0, max_mean_err=float("nan"), tie=50.0, max_tie_share=1.0,
                            floor=1e9))
    assert lax.rel_tol <= both.rel_tol and lax.min_overlap >= both.min_overlap and lax.tie <= both.tie
    assert lax.max_mean_err <= both.max_mean_err and lax.max_tie_share <= both.max_tie_share
    strict = Tolerance(rel_tol=0.01, min_overlap=0.95)
    assert clamped(strict).rel_tol == 0.01 and clamped(strict).min_overlap == 0.95  # tightening is the asker's


# --- the attacker, through verify jobs --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q4(fixtures_dir, tmp_path_factory):
    return cheat_fixtures.quantized(fixtures_dir / "gemma4-tiny", tmp_path_factory.mktemp("q4") / "q4", 4)


async def _made(node, model: str, sampling: SamplingParams, job_id: str) -> tuple[list[int], Done]:
    ids, _, end, _ = await collect(node, Job(id=job_id, model=model, prompt_ids=PROMPT, sampling=sampling))
    assert isinstance(end, Done), end
    return ids, end


def _forged(node, ids, proof: Proof) -> Proof:
    lm = node.models.acquire("m")
    try:
        end = [proof.end_token] if proof.end_token is not None else []
        return dataclasses.replace(proof, commitment=forged_commitment(lm, PROMPT, list(ids) + end))
    finally:
        node.models.release("m")


async def _verify(node, sampling: SamplingParams, ids, proof: Proof, job_id: str):
    """A verify job for the claim, the request's sampling as the original's: its verdict (never an Error)."""
    _, _, end, _ = await collect(node, Job(id=job_id, model="m", prompt_ids=PROMPT, sampling=sampling,
                                           verify=Claim(tuple(ids), proof)))
    assert isinstance(end, Done) and end.verdict is not None, end
    return end.verdict


def test_the_forger_with_the_real_weights_is_caught_on_every_lie_and_honest_outputs_pass(fixtures_dir, q4):
    node = make_node({"m": fixtures_dir / "gemma4-tiny", "q4": q4}, commitments="on", speculation="off",
                     manager_kw={"max_resident": 4})

    async def main():
        cases = {}  # name -> (request sampling, claimed ids, proof, where it must fail or None to pass)
        for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED), ("unseeded", UNSEEDED)):
            ids, done = await _made(node, "m", sampling, f"honest-{name}")
            cases[f"honest {name}"] = (sampling, ids, done.proof, None)
        for name, sampling in (("seeded", SEEDED), ("seeded top_p 1", SEEDED_FULL)):
            cheap, _ = await _made(node, "q4", sampling, f"cheap-{name}")  # the 4-bit copy's draws
            lie = _forged(node, cheap, Proof(None, "speculative"))
            cases[f"4-bit tokens on a {name} job, claimed speculative"] = (sampling, cheap, lie, 0)
        other, done = await _made(node, "m", dataclasses.replace(SEEDED, seed=99), "other-seed")
        cases["another seed's output, named replayable"] = (SEEDED, other, done.proof, 0)
        greedy_ids, done = await _made(node, "m", GREEDY, "greedy-for-sampled")
        cases["greedy tokens for a sampled job, claimed greedy"] = (SEEDED, greedy_ids, done.proof, 0)
        cases["greedy tokens for an unseeded job, claimed greedy"] = (UNSEEDED, greedy_ids, done.proof, 0)
        noise = [(7 * i + 3) % 250 + 3 for i in range(32)]
        for label in ("speculative", "replayable"):
            lie = _forged(node, noise, Proof(None, label, seed=5 if label == "replayable" else None))
            cases[f"random tokens on a greedy job, claimed {label}"] = (GREEDY, noise, lie, 0)
        long_ids, done = await _made(node, "m", GREEDY, "long")
        short = dataclasses.replace(GREEDY, max_tokens=4)
        cases["32 tokens on a max_tokens 4 job"] = (short, long_ids, _forged(node, long_ids, done.proof), 4)
        assert done.finish_reason.value == "length" and len(long_ids) == 32
        eos = next(iter(node.models.acquire("m").tokenizer.eos_token_ids))
        node.models.release("m")
        for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
            ids, done = await _made(node, "m", sampling, f"whole-{name}")
            if done.proof.end_token is not None:
                continue  # ended on its own: nothing to cut
            k = 9
            cases[f"a {name} output cut at {k} with a made-up end"] = (
                sampling, ids[:k], _forged(node, ids[:k], Proof(None, done.proof.sampler, done.proof.seed, eos)), k)
            cases[f"a {name} output cut at {k} with no end"] = (
                sampling, ids[:k], _forged(node, ids[:k], Proof(None, done.proof.sampler, done.proof.seed)), k)
        verdicts = {}
        for i, (name, (sampling, ids, proof, where)) in enumerate(cases.items()):
            verdicts[name] = (await _verify(node, sampling, ids, proof, f"v{i}"), where)
        return verdicts

    verdicts = run(main())
    run(node.stop())
    assert any("cut at" in name for name in verdicts), "no output ran to its limit to cut"
    for name, (v, where) in verdicts.items():
        if where is None:
            assert v.passed, (name, v)
        else:
            assert not v.passed and v.first_failure == where, (name, v)


@pytest.mark.parametrize("seeded", [True, False])
def test_honest_speculating_outputs_pass_coupled_and_unseeded(seeded):
    node = make_node({"m": DEMO_TARGET}, commitments="on", speculation="on", speculation_k=3,
                     manager_kw={"drafters": {"m": DEMO_ASSISTANT}})
    sampling = SEEDED if seeded else UNSEEDED

    async def main():
        out = []
        for i in range(3):
            s = dataclasses.replace(sampling, seed=sampling.seed + i) if seeded else sampling
            ids, done = await _made(node, "m", s, f"spec-{i}")
            assert done.telemetry.speculation.mode.value == "mtp", done.telemetry.speculation
            assert done.proof.sampler == ("replayable" if seeded else "speculative")
            out.append(await _verify(node, s, ids, done.proof, f"v-{i}"))
        return out

    verdicts = run(main())
    run(node.stop())
    assert all(v.passed for v in verdicts), verdicts


def test_provider_verify_fails_lies_with_exit_1_and_never_crashes(fixtures_dir, tmp_path):
    """Through the command: a greedy job claimed speculative used to divide by temperature 0 (exit 70); it and the
    other lies are failed verdicts now (exit 1), the honest claim passes (exit 0)."""
    from google.protobuf import json_format

    node = make_node({"m": fixtures_dir / "gemma4-tiny"}, commitments="on", speculation="off")
    original = pb.JobRequest(job_id="j", model="m", max_tokens=24, sampling=pb.SamplingParams(temperature=0.0),
                             prompt_ids=pb.PromptTokens(ids=PROMPT))
    job = convert.job_from_request(original, max_tokens_limit=4096, default_max_tokens=256)
    ids, _, end, _ = run(collect(node, job))
    lm = node.models.acquire("m")
    forged = forged_commitment(lm, PROMPT, ids + ([end.proof.end_token] if end.proof.end_token is not None else []))
    node.models.release("m")
    run(node.stop())
    short = pb.JobRequest()
    short.CopyFrom(original)
    short.max_tokens = 4
    claims = {
        "honest": (original, end.proof, 0),
        "speculative on greedy": (original, dataclasses.replace(end.proof, sampler="speculative", commitment=forged), 1),
        "replayable on greedy": (original, dataclasses.replace(end.proof, sampler="replayable", seed=3), 1),
        "overlong": (short, end.proof, 1),
    }
    for name, (request, proof, _) in claims.items():
        claim = SpotChecks(1.0).verify_request(request, ids, convert.proof_to_pb(proof))
        (tmp_path / f"{name}.json").write_text(json_format.MessageToJson(claim))

    async def verify(name):
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "provider", "verify", str(tmp_path / f"{name}.json"), "--model",
            str(fixtures_dir / "gemma4-tiny"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(p.communicate(), 300)
        return p.returncode, out.decode(), err.decode()

    async def main():
        return await asyncio.gather(*(verify(name) for name in claims))

    for (name, (_, _, code)), (rc, out, err) in zip(claims.items(), run(main())):
        assert rc == code, (name, rc, err)
        verdict = json.loads(out)
        assert verdict["passed"] == (code == 0), (name, verdict)
        if code:
            assert verdict["reason"] and verdict["first_failure"] in (0, 4), (name, verdict)


def test_a_claim_past_the_context_fails_its_verdict_unread_instead_of_erroring(fixtures_dir):
    """Issue 56: a claim whose end token sat one position past the context was read there. The request allows what
    the context holds after the prompt; the end token counts. A claim past it fails at the limit, never an Error."""
    node = make_node({"m": fixtures_dir / "gemma4-tiny"}, commitments="on", speculation="off")
    run(node.preload("m"))
    lm = node.models.acquire("m")
    context, eos, hidden = lm.context_length, next(iter(lm.tokenizer.eos_token_ids)), lm.hidden_tap.hidden_size
    node.models.release("m")

    def commitment(n: int) -> bytes:  # well formed, so only the length can fail it
        builder = CommitmentBuilder(hidden)
        builder.add(np.tile(np.arange(4), (n, 1)), np.zeros((n, 4), np.uint16))
        return builder.finish(n)

    prompt = tuple((5 + i) % 200 + 3 for i in range(context - 4))
    sampling = SamplingParams(max_tokens=64, temperature=0.0)

    async def main():
        made, _, end, _ = await collect(node, Job(id="made", model="m", prompt_ids=prompt, sampling=sampling))
        assert len(made) == 4 and end.finish_reason.value == "length"  # the context held 4 more
        out = []
        for ids, end in ((made, eos), (made + [7] * 36, None)):  # the model's own 4, then one or 36 past the context
            job = Job(id=f"v{len(out)}", model="m", prompt_ids=prompt, sampling=sampling,
                      verify=Claim(tuple(ids), Proof(commitment(len(ids) + (end is not None)), "greedy",
                                                     end_token=end)))
            _, _, done, _ = await collect(node, job)
            out.append(done)
        return out

    verdicts = run(main())
    run(node.stop())
    for done in verdicts:
        assert isinstance(done, Done) and done.verdict is not None and not done.verdict.passed, done
        assert done.verdict.first_failure == 4 and "allowed at most 4" in done.verdict.reason, done.verdict


# --- a filter's boundary, where two honest forwards round apart -----------------------------------------------

def test_a_token_within_the_tie_of_a_top_k_boundary_is_judged_both_ways_and_one_past_it_is_not():
    """support_scores on numbers: the 3rd and 4th tokens tie within the tolerance at top_k 3, so the producer may
    have kept either; a draw of the 4th passes only when it beats everything surely kept, a token clearly outside
    never passes, and the same numbers with a clear gap at the boundary judge exactly as before."""
    import mlx.core as mx

    from provider.engine.sampling import position_key
    from provider.verification.replay import token_gaps

    tie = CPU.tie
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=7)
    probs = np.array([0.5, 0.2, 0.1, 0.1 * np.exp(-tie / 4), 0.05, 0.05 * np.exp(-tie / 4)])
    logprobs = mx.array(np.log(probs / probs.sum())[None, :].astype(np.float32))

    def gap(token, lp=logprobs, sampler="replayable", edge=tie):
        return float(token_gaps(lp, [token], [0], params, sampler, 7, None, edge=edge)[0])

    noise = np.array(mx.random.gumbel((6,), key=position_key(7, 0)))
    scores = np.log(probs / probs.sum()) + noise
    surely = max(scores[:2])  # tokens 0 and 1 are more than `tie` inside the boundary; 2 and 3 tie at it
    for token in (2, 3):
        assert gap(token) == pytest.approx(max(0.0, surely - scores[token]), abs=1e-4)
    assert gap(4) == gap(5) == float("inf")  # outside by more than the tie: never drawn
    assert gap(3, edge=0.0) == float("inf")  # without the edge, the verifier's own top 3 decides alone
    assert gap(3, sampler="speculative") < CPU.floor and gap(4, sampler="speculative") == float("inf")
    clear = mx.array(np.log(np.array([0.5, 0.2, 0.1, 0.02, 0.01, 0.01]))[None, :].astype(np.float32))
    assert gap(3, lp=clear) == float("inf")


def test_a_seeded_top_k_job_whose_kth_place_ties_in_float16_passes():
    """The campaign's one false rejection (verify_campaign --seed 55, job h672), replayed: a seeded top_k 40 job on
    the float16 demo model, decoded plain (speculation gives the same tokens). At output 5 the 40th to 42nd tokens
    tie in the producer's float16 log-softmax and part by 0.005 nats in the verifier's float32 one; the token the
    verifier's support kept drew the largest noise, so without the boundary's tolerance the honest output failed
    at 5 (seen, gap 6.64 nats). Checked to still be that case: the gap at 5 with no edge is past the tie."""
    import mlx.core as mx

    from provider.verification.replay import processed, token_gaps

    text = ("n): The one -= model 日本語のテキスト。 🚀 0 model = stream A Привет is Cache: 🙂 token The serves A yield with "
            "speculation? while self.offset models Pack vexingly A is language zebras 9 token ✨. the 2.71828. five")
    sampling = SamplingParams(max_tokens=20, temperature=0.6, top_k=40, seed=1229655378, logprobs=2)
    node = make_node({"m": DEMO_TARGET}, commitments="on", speculation="off")

    async def main():
        job = Job(id="h672", model="m", messages=({"role": "user", "content": text},), sampling=sampling)
        ids, _, done, _ = await collect(node, job)
        claim = Claim(tuple(ids), done.proof)
        _, _, end, _ = await collect(node, dataclasses.replace(job, id="v", verify=claim))
        return ids, end.verdict, node.prompts.prepare(job).result().prompt

    ids, verdict, prompt = run(main())
    lm = node.models.acquire("m")
    try:
        logits = lm.model(mx.array(list(prompt) + ids)[None])[0, len(prompt) - 1 + 5:len(prompt) + 5]
        lp = processed(logits, sampling, list(prompt) + ids, len(prompt) + 5)
        strict = float(token_gaps(lp, [ids[5]], [5], sampling, "replayable", sampling.seed, lm.decodable)[0])
    finally:
        node.models.release("m")
        run(node.stop())
    assert strict > CPU.tie, f"the boundary no longer ties here ({strict}): this test no longer checks it"
    assert verdict.passed and verdict.tokens == 20, verdict
