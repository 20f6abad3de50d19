"""Grammar replay in the verifier (issue 39): a constrained job's claim is read under the masks its producer drew
its tokens under, recomputed from the job's own grammar along the claimed tokens, so greedy and seeded
constrained work is checked exactly and a token the grammar forbids fails the claim where it stands. Real
fixture checkpoints the factory builds, real llguidance, the node's own engine."""

from __future__ import annotations

import asyncio
import dataclasses

import mlx.core as mx
import numpy as np

from provider.constraints import OutputRules, ResponseFormat, Tool, ToolChoice
from provider.engine.grammar import RowGrammar
from provider.engine.grammar_compile import Compiler
from provider.engine.output import end_ids
from provider.jobs import Claim as Claimed
from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Error, Proof
from provider.prompts import CompiledGrammar
from provider.proofs.commitment import CommitmentBuilder
from provider.verification.replay import GrammarReplay
from provider.verification.verifier import Claim, ClaimReader
from tests.helpers import collect, make_node, run
from tools.harness.forger import forged_commitment

# A JSON schema with a regex (`pattern`), an enum and a bounded integer: three kinds of constraint in one grammar.
SCHEMA = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                           "kind": {"enum": ["capital", "town", "village"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["code", "kind", "n"]}
JSON = OutputRules(ResponseFormat("json_schema", SCHEMA, "place"))
WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                                "days": {"type": "integer"}},
                               "required": ["city", "days"]})
CALL = OutputRules(tools=(WEATHER,), tool_choice=ToolChoice("function", "get_weather"))  # the format's Lark grammar
AUTO = OutputRules(tools=(WEATHER,), tool_choice=ToolChoice("auto"))  # free text until a call's marker
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)
SEEDED = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=7)
UNSEEDED = SamplingParams(max_tokens=48, temperature=1.0)  # the node draws a seed and says it
PROMPT = (1, 5, 9, 13, 17)
MESSAGES = ({"role": "user", "content": "The weather in Paris?"},)


def _job(job_id: str, model: str, rules: OutputRules, sampling: SamplingParams, **kw) -> Job:
    where = {"messages": MESSAGES} if rules.calls_tools else {"prompt_ids": PROMPT}
    return Job(job_id, model, sampling, rules=rules, **where, **kw)


async def _produce(node, jobs: list[Job]) -> list[tuple[list[int], Proof]]:
    outs = await asyncio.gather(*(collect(node, j) for j in jobs))
    for ids, _, end, _ in outs:
        assert isinstance(end, Done) and end.proof is not None, end
    return [(ids, end.proof) for ids, _, end, _ in outs]


def _read(node, job: Job, ids, proof: Proof, step: int = 512, grammar=True) -> ClaimReader:
    """The claim read by the node's verifier as a verify job reads it: the job prepared (templated, its grammar
    compiled from its own rules, as for generating it), the claim through the real model a chunk of `step` a pass.
    `grammar`: True for the job's own, None for none (the verifier before grammar replay), or a CompiledGrammar."""
    prepared = node.prompts.prepare(job).result()
    run(node.preload(job.model))
    lm = node.models.acquire(job.model)
    try:
        compiled = prepared.grammar if grammar is True else grammar
        reader = ClaimReader(lm, Claim(prepared.prompt, tuple(ids), prepared.job.sampling, proof), compiled)
        while not reader.done:
            reader.step(step)
        return reader
    finally:
        node.models.release(job.model)


def _forged(node, job: Job, ids, proof: Proof) -> Proof:
    """A commitment to `ids` made with the real weights (what anyone holding them can make for any output): the
    hidden-state check then passes, and only the token checks stand between the claim and a pass."""
    prepared = node.prompts.prepare(job).result()
    run(node.preload(job.model))
    lm = node.models.acquire(job.model)
    try:
        end = [proof.end_token] if proof.end_token is not None else []
        return dataclasses.replace(proof, commitment=forged_commitment(lm, prepared.prompt, list(ids) + end))
    finally:
        node.models.release(job.model)


def _masks_and_logits(node, job: Job, ids) -> tuple[np.ndarray, np.ndarray]:
    """Per output position: what the job's grammar allows there after the claimed tokens before it (walked as the
    producer's row walks it), and the model's raw logits there."""
    prepared = node.prompts.prepare(job).result()
    lm = node.models.acquire(job.model)
    try:
        walk = GrammarReplay(RowGrammar.of(prepared.grammar, lm.logits_width, end_ids(lm.tokenizer, job.sampling)))
        masks = walk.masks(list(ids), 0)
        logits = lm.model(mx.array(list(prepared.prompt) + list(ids[:-1]))[None])[0, len(prepared.prompt) - 1:]
        return masks, np.array(logits.astype(mx.float32))
    finally:
        node.models.release(job.model)


def _producer(fixtures_dir, **kw):
    return make_node({"g": fixtures_dir / "gemma4-tiny", "t": fixtures_dir / "gemma4-tools"}, commitments="on",
                     speculation="off", max_concurrent_jobs=8, manager_kw={"max_resident": 4}, **kw)


def test_honest_constrained_claims_pass_alone_in_a_batch_and_across_any_chunking(fixtures_dir):
    """A JSON schema (regex, enum, integer) and a forced call in Gemma 4's format (its Lark grammar), greedy,
    seeded and unseeded, and `auto` tools (free text until a call): made alone and in one batch, each passes
    by a verify job and by the verifier read in chunks of 7 (the grammar's walk crosses chunk boundaries) and
    512. Read without the grammar, the constrained ones fail: the masks decided their tokens."""
    node = _producer(fixtures_dir)
    cases = [("g", JSON, GREEDY), ("g", JSON, SEEDED), ("g", JSON, UNSEEDED), ("t", CALL, GREEDY),
             ("t", CALL, SEEDED), ("t", AUTO, SEEDED)]
    jobs = [_job(f"b{i}", m, r, s) for i, (m, r, s) in enumerate(cases)]

    async def main():
        alone = await _produce(node, [_job("alone", "g", JSON, GREEDY)])
        return alone + await _produce(node, jobs)

    outs = run(main())
    for job, (ids, proof) in zip([_job("alone", "g", JSON, GREEDY)] + jobs, outs):
        assert proof.sampler == ("greedy" if job.sampling.greedy else "replayable")
        verify = dataclasses.replace(job, id=job.id + "-v", verify=Claimed(tuple(ids), proof))  # the node's verify job
        _, _, done, _ = run(collect(node, verify))
        assert isinstance(done, Done) and done.verdict.passed, (job.id, done)
        for step in (7, 512):
            verdict = _read(node, job, ids, proof, step).verdict()
            assert verdict.passed, (job.id, step, verdict.summary())
        if job.rules is not AUTO:
            unmasked = _read(node, job, ids, proof, grammar=None).verdict()
            assert not unmasked.passed, (job.id, "the grammar decided nothing: this case checks nothing")
    run(node.stop())


def test_claims_made_speculating_under_a_grammar_pass(fixtures_dir):
    """The llama pair speculating under a schema (drafts and the target's k+1 positions masked): greedy and seeded
    (coupled draws, replayed exactly) and unseeded (speculative sampling, checked for plausibility under the
    masks) all pass."""
    node = make_node({"l": fixtures_dir / "llama-tiny"}, commitments="on", speculation="on", speculation_k=3,
                     manager_kw={"drafters": {"l": fixtures_dir / "llama-tiny-draft"}}, max_concurrent_jobs=4)
    jobs = [_job(f"s{i}", "l", JSON, s) for i, s in enumerate([GREEDY, SEEDED, UNSEEDED])]

    async def main():
        outs = []
        for j in jobs:  # one at a time: each speculates (a batch may judge speculation unprofitable)
            ids, _, end, _ = await collect(node, j)
            assert isinstance(end, Done) and end.telemetry.speculation.rounds > 0, end
            outs.append((ids, end.proof))
        return outs

    outs = run(main())
    assert [p.sampler for _, p in outs] == ["greedy", "replayable", "speculative"]
    for job, (ids, proof) in zip(jobs, outs):
        for step in (5, 512):
            verdict = _read(node, job, ids, proof, step).verdict()
            assert verdict.passed, (job.id, step, verdict.summary())
    run(node.stop())


def test_a_claim_that_leaves_its_grammar_fails_at_the_token_that_leaves_it(fixtures_dir):
    """An honest claim with one token swapped at position 12 for the model's likeliest token the grammar forbids
    there, committed to with the real weights and claimed at the laxest check (unseeded speculative sampling:
    plausibility only): it fails at 12, as outside the grammar. Without the grammar the same claim passes."""
    node = _producer(fixtures_dir)
    job = _job("honest", "g", JSON, UNSEEDED)
    ((ids, honest),) = run(_produce(node, [job]))
    k = 12
    masks, logits = _masks_and_logits(node, job, ids)
    outside = np.where(masks[k], -np.inf, logits[k])
    outside[sorted(end_ids(node.models.acquire("g").tokenizer, job.sampling))] = -np.inf  # an end is no token
    node.models.release("g")
    bad = int(np.argmax(outside))
    claim = ids[:k] + [bad] + ids[k + 1:]
    proof = _forged(node, job, claim, Proof(None, "speculative", end_token=honest.end_token))  # its honest end
    verdict = _read(node, job, claim, proof, step=7).verdict()
    assert not verdict.passed and verdict.first_failure == k, verdict.summary()
    assert "grammar forbids" in verdict.reason, verdict.reason
    assert _read(node, job, claim, proof, grammar=None).verdict().passed  # what plausibility alone let through
    run(node.stop())


def test_output_made_without_the_grammar_claimed_as_constrained_fails_where_it_first_differs(fixtures_dir):
    """A cheat copies the constrained output's first 16 tokens, then decodes on without the grammar (greedy, and
    seeded with the declared seed), commits with the real weights and claims the whole as the constrained job's:
    it fails at the first token that differs from the honest constrained output, never before."""
    node = _producer(fixtures_dir)
    head = 16
    for sampling in (GREEDY, SEEDED):
        job = _job(f"c{sampling.temperature}", "g", JSON, sampling)
        ((honest, proof),) = run(_produce(node, [job]))
        free = Job(job.id + "-free", "g", dataclasses.replace(sampling, max_tokens=sampling.max_tokens - head),
                   prompt_ids=PROMPT + tuple(honest[:head]))
        ((tail, _),) = run(_produce(node, [free]))
        claim = honest[:head] + tail
        start = next(j for j, (a, b) in enumerate(zip(claim, honest)) if a != b)
        verdict = _read(node, job, claim, _forged(node, job, claim, proof), step=7).verdict()
        assert not verdict.passed and verdict.first_failure == start, (sampling, start, verdict.summary())
    run(node.stop())


def test_greedy_constrained_claims_are_checked_exactly_under_the_masks(fixtures_dir):
    """On an honest greedy constrained output: the unconstrained argmax put where the grammar's argmax was fails
    there as outside the grammar; a token the grammar allows but that is not its argmax fails there as not the
    model's (plausibility would pass it). Both committed to with the real weights."""
    node = _producer(fixtures_dir)
    job = _job("greedy", "g", JSON, GREEDY)
    ((ids, proof),) = run(_produce(node, [job]))
    masks, logits = _masks_and_logits(node, job, ids)
    k = next(j for j in range(1, len(ids)) if int(np.argmax(logits[j])) != ids[j])
    claim = ids[:k] + [int(np.argmax(logits[k]))] + ids[k + 1:]
    verdict = _read(node, job, claim, _forged(node, job, claim, proof), step=7).verdict()
    assert not verdict.passed and verdict.first_failure == k and "grammar forbids" in verdict.reason, \
        (k, verdict.summary())
    m = next(j for j in range(1, len(ids)) if masks[j].sum() >= 2)
    allowed = np.where(masks[m], logits[m], -np.inf)
    allowed[ids[m]] = -np.inf
    second = int(np.argmax(allowed))
    claim = ids[:m] + [second] + ids[m + 1:]
    verdict = _read(node, job, claim, _forged(node, job, claim, proof), step=7).verdict()
    assert not verdict.passed and verdict.first_failure == m and verdict.reason.endswith("is not the model's"), \
        (m, verdict.summary())
    run(node.stop())


def test_hostile_grammars_are_refused_as_for_generating_and_a_bound_reached_fails_the_claim_where_it_stopped(
        fixtures_dir):
    """A schema whose regex does not compile: the verify job is refused as the generating job is (invalid_request
    naming response_format), nothing native sees it. A grammar whose steps outgrow the matcher's bounds: the
    producer's row stops at a token (it fails, with no outcome); a claim running past that token fails there,
    the walk across chunks of 7, and the node goes on serving."""
    node = _producer(fixtures_dir)
    hostile = OutputRules(ResponseFormat("json_schema", {"type": "string", "pattern": "(unclosed"}, "bad"))
    ((ids, proof),) = run(_produce(node, [_job("ok", "g", JSON, GREEDY)]))
    made = run(collect(node, _job("made", "g", hostile, GREEDY)))[2]
    checked = run(collect(node, _job("checked", "g", hostile, GREEDY, verify=Claimed(tuple(ids), proof))))[2]
    for end in (made, checked):
        assert isinstance(end, Error) and end.cause.value == "invalid_request" and end.param == "response_format", end

    run(node.preload("g"))
    lm = node.models.acquire("g")
    tok = lm.tokenizer
    node.models.release("g")
    (a,), (b,) = (tok.encode(c, add_special_tokens=False) for c in "ab")
    compiler = Compiler(tok, lm.logits_width, {"step_max_items": 40})

    def grammar():
        return CompiledGrammar(compiler.matcher('start: "a" x\nx: x x | "b"', "response_format"), lm.logits_width,
                               "json_schema")

    row = RowGrammar.of(grammar(), lm.logits_width, set(tok.eos_token_ids))  # as the producer's row decodes
    row.consume([a])
    for stop in range(1, 200):  # "b" while the grammar allows it, as a sampler under its masks draws
        assert row.allowed()[b] or row.error is not None
        if row.error is not None:
            break  # the row fails here: token `stop` is never drawn
        row.consume([b])
    assert row.error is not None and stop > 8, stop
    claim = [a] + [b] * (stop + 10)
    job = _job("bounded", "g", JSON, UNSEEDED)
    forged = _forged(node, job, claim, Proof(None, "speculative"))
    verdict = _read(node, job, claim, forged, step=7, grammar=grammar()).verdict()
    assert not verdict.passed and verdict.first_failure == stop and "stopped" in verdict.reason, \
        (stop, verdict.summary())
    assert isinstance(run(collect(node, _job("after", "g", JSON, GREEDY)))[2], Done)  # still serving
    run(node.stop())
