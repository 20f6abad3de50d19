"""Where an output ends is checked too: an output that ends on an end token carries it in its proof
(`Proof.end_token`), the commitment covers its row, and a verifier judges it as the output's last token. An
output cut short with a made-up end, an end token that is not one, and a cheat's empty output all fail there."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from coordinator_client.convert import job_from_request, proof_from_pb, proof_to_pb
from coordinator_client.outcomes import proof_digest
from coordinator_client.pb import provider_pb2 as pb
from provider.jobs import Claim as JobClaim
from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Proof
from tools.fixtures import cheats as cheat_fixtures
from provider.types import JobError
from provider.proofs.commitment import CommitmentBuilder, decode
from provider.verification.verifier import Claim, ClaimReader, Verdict
from tests.helpers import collect, make_node, run
from tools.harness.forger import forged_commitment

PROMPTS = [(1, 5, 9, 13, 17), (1, 40, 41, 42), (1, 100, 7, 300, 12, 9, 33)]


def eos_of(node, model: str = "m") -> int:
    run(node.preload(model))
    lm = node.models.acquire(model)
    node.models.release(model)
    return min(lm.tokenizer.eos_token_ids)


def biased(eos: int, bias: float, seed: int | None, max_tokens: int = 40) -> SamplingParams:
    """The end token made likely by logit bias, so outputs end early on it (at position 0 when strong)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 0.8, seed=seed,
                          logit_bias=((eos, bias),))


async def made(node, prompt, sampling: SamplingParams, job_id: str, model: str = "m") -> tuple[list[int], Done]:
    ids, _, end, _ = await collect(node, Job(id=job_id, model=model, prompt_ids=tuple(prompt), sampling=sampling))
    assert isinstance(end, Done) and end.proof is not None and end.proof.commitment is not None, end
    return ids, end


def read(node, prompt, ids, sampling: SamplingParams, proof: Proof, step: int = 64) -> ClaimReader:
    run(node.preload("m"))
    lm = node.models.acquire("m")
    try:
        reader = ClaimReader(lm, Claim(tuple(prompt), tuple(ids), sampling, proof))
        while not reader.done:
            reader.step(step)
        return reader
    finally:
        node.models.release("m")


def check(node, prompt, ids, sampling, proof, step: int = 64) -> Verdict:
    return read(node, prompt, ids, sampling, proof, step).verdict()


def forged(node, prompt, ids, sampling, proof: Proof) -> Proof:
    """A commitment made with the real weights to `ids` and the proof's end token (what anyone holding them can
    make for any output): the hidden states then match, and only the token check judges the end."""
    lm = node.models.acquire("m")
    try:
        end = [proof.end_token] if proof.end_token is not None else []
        return dataclasses.replace(proof, commitment=forged_commitment(lm, prompt, list(ids) + end))
    finally:
        node.models.release("m")


@pytest.mark.parametrize("spec", ["plain", "mtp"])
def test_honest_outputs_that_end_on_an_end_token_carry_it_and_pass(fixtures_dir, demo_f32, spec):
    """Greedy and seeded, ending at position 0 and later, plain rows and speculative rounds (where the end token
    is accepted inside a round: its row must come right after the last emitted one). Plain rows end on the
    model's EOS made likely by logit bias; speculating rows (logit bias keeps a job from speculating) on a stop
    id, one of the job's end ids, taken from where an unstopped run of the same job went."""
    model = fixtures_dir / "gemma4-tiny" if spec == "plain" else demo_f32[0]  # the demo pair in float32
    node = make_node({"m": model}, commitments="on", speculation="off" if spec == "plain" else "on",
                     speculation_k=3, manager_kw={"drafters": {"m": demo_f32[1]}} if spec == "mtp" else None)
    eos = eos_of(node)
    free = [(p, SamplingParams(max_tokens=24, temperature=0.0 if seed is None else 0.8, seed=seed))
            for p in PROMPTS for seed in (None, 1)]

    async def main(cases):
        return await asyncio.gather(*(made(node, p, s, f"j{len(cases)}-{i}") for i, (p, s) in enumerate(cases)))

    if spec == "plain":
        cases = [(p, biased(eos, bias, seed)) for p in PROMPTS for bias in (2.0, 4.0, 9.0) for seed in (None, 1, 2)]
    else:
        runs = zip(free, run(main(free)))
        cases = [(p, dataclasses.replace(s, stop_token_ids=(ids[k],))) for (p, s), (ids, _) in runs
                 for k in (0, 5, 11) if len(ids) > k]
    outs = run(main(cases))
    lengths = []
    for (prompt, sampling), (ids, done) in zip(cases, outs):
        proof = done.proof
        if done.finish_reason.value == "length":
            assert proof.end_token is None and len(decode(proof.commitment, len(ids))) >= 1
            continue
        assert proof.end_token in {eos, *sampling.stop_token_ids}, (done.finish_reason, proof)
        if spec == "mtp":
            assert done.telemetry.speculation.mode.value == "mtp", done.telemetry.speculation
        decode(proof.commitment, len(ids) + 1)  # one row past the output: the end token's
        verdict = check(node, prompt, ids, sampling, proof, step=7)
        assert verdict.passed and verdict.tokens == len(ids) + 1, verdict.summary()
        lengths.append(len(ids))
    assert 0 in lengths and any(n > 3 for n in lengths), lengths  # ends at position 0 and mid-output both seen
    run(node.stop())


def test_an_end_token_dropped_from_the_proof_or_made_up_fails_where_it_stands(fixtures_dir):
    node = make_node({"m": fixtures_dir / "gemma4-tiny"}, commitments="on", speculation="off")
    eos = eos_of(node)
    ended = biased(eos, 2.0, 1)
    long = SamplingParams(max_tokens=16, temperature=0.8, seed=4)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    ids, done = run(made(node, PROMPTS[0], ended, "ended"))
    assert done.proof.end_token == eos and len(ids) > 3

    # Its end token dropped, the commitment kept: the commitment is to one more row than the claim has, so it
    # cannot be read as the claim's (a claim without an end says the output ended on max_tokens or a stop string).
    dropped = check(node, PROMPTS[0], ids, ended, dataclasses.replace(done.proof, end_token=None))
    assert not dropped.passed and dropped.first_failure == 0 and "commitment unreadable" in dropped.reason

    # Honest outputs that ran to max_tokens, cut at 10 with a made-up end and a commitment made with the real
    # weights: the hidden states match, the end token is not what the model chose at position 10.
    for sampling in (long, greedy):
        full, whole = run(made(node, PROMPTS[1], sampling, f"long-{sampling.seed}"))
        assert whole.finish_reason.value == "length" and whole.proof.end_token is None
        cut = dataclasses.replace(whole.proof, end_token=eos)
        verdict = check(node, PROMPTS[1], full[:10], sampling, forged(node, PROMPTS[1], full[:10], sampling, cut))
        assert not verdict.passed and verdict.first_failure == 10, verdict.summary()
        assert verdict.reason == "output token 10 is not the model's"

    # An end token that is not one of the job's end ids (any uint32): fails at its position, never read.
    for bad in (7, 70_000, (1 << 32) - 1):
        verdict = check(node, PROMPTS[0], ids, ended, dataclasses.replace(done.proof, end_token=bad))
        assert not verdict.passed and verdict.first_failure == len(ids), verdict.summary()
        assert f"output token {len(ids)} ({bad}) is claimed to end the output" in verdict.reason
    with pytest.raises(JobError):  # past the wire's uint32: refused as the request's fault
        JobClaim(tuple(ids), dataclasses.replace(done.proof, end_token=1 << 40))
    with pytest.raises(JobError):  # an empty output claims nothing unless it ended on an end token
        JobClaim((), dataclasses.replace(done.proof, end_token=None))

    # The same claims as verify jobs through the node: the honest one passes, a non-end id fails typed.
    async def verify():
        out = []
        for i, end in enumerate((eos, (1 << 32) - 1)):
            job = Job(id=f"v{i}", model="m", prompt_ids=PROMPTS[0], sampling=ended,
                      verify=JobClaim(tuple(ids), dataclasses.replace(done.proof, end_token=end)))
            out.append((await collect(node, job))[2])
        return out

    honest, bad = run(verify())
    assert honest.verdict.passed and honest.verdict.tokens == len(ids) + 1, honest.verdict
    assert not bad.verdict.passed and bad.verdict.first_failure == len(ids), bad.verdict
    run(node.stop())


def test_the_end_token_crosses_the_wire_both_ways():
    proof = Proof(b"C\x01\x04\x20" + b"\0" * 10, "replayable", 3, 2)
    assert proof_from_pb(proof_to_pb(proof)) == proof
    assert not proof_to_pb(dataclasses.replace(proof, end_token=None)).HasField("end_token")
    assert proof_from_pb(proof_to_pb(dataclasses.replace(proof, end_token=None))).end_token is None
    # The signed result covers it: proof_sha256 is over the serialized proof, end token included.
    digests = {proof_digest(proof_to_pb(dataclasses.replace(proof, end_token=e))) for e in (None, 2, 5)}
    assert len(digests) == 3
    # An empty output that ended on its end token is a claim a verify job takes.
    req = pb.JobRequest(job_id="v", model="m", max_tokens=4, prompt_ids=pb.PromptTokens(ids=[1, 2]),
                        verify=pb.VerifyInput(proof=proof_to_pb(proof)))
    job = job_from_request(req, max_tokens_limit=64, default_max_tokens=16)
    assert job.verify.output == () and job.verify.proof.end_token == 2


def test_a_cheats_empty_output_is_caught_at_its_end_token(fixtures_dir, tmp_path):
    """Weights 1% off, seeded, the end token made likely: its outputs that end at once (empty, the end token
    alone) fail at position 0 on a node with the real weights; the honest node's pass."""
    real = fixtures_dir / "gemma4-tiny"
    cheat = make_node({"m": cheat_fixtures.noisy(real, tmp_path / "noisy", 0.01)}, commitments="on",
                      speculation="off")
    honest = make_node({"m": real}, commitments="on", speculation="off")
    eos = eos_of(honest)
    cases = [(p, biased(eos, 5.0, seed, 24)) for p in PROMPTS for seed in range(1, 7)]

    async def main(node):
        return await asyncio.gather(*(made(node, p, s, f"c{i}") for i, (p, s) in enumerate(cases)))

    for node, should_pass in ((cheat, False), (honest, True)):
        empty = 0
        for (prompt, sampling), (ids, done) in zip(cases, run(main(node))):
            if ids or done.proof.end_token is None:
                continue
            empty += 1
            verdict = check(honest, prompt, ids, sampling, done.proof)
            assert verdict.passed == should_pass and verdict.tokens == 1, verdict.summary()
            assert should_pass or (verdict.first_failure == 0 and "hidden states" in verdict.reason), verdict.reason
        assert empty >= 3, empty
    run(cheat.stop())
    run(honest.stop())
