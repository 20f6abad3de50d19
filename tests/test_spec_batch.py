"""Speculation inside the batch: rows drafted and verified together, each with its own acceptance and
rollback, joining and leaving between rounds, on the trained demo pair (an MTP assistant that agrees with
its target often but not always) and a same-vocabulary draft model, checked against bare mlx-lm."""

import asyncio
import itertools

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from provider.engine.drafters import MTPDrafter
from provider.engine.speculative import SpecStats, Speculator, Target
from provider.jobs import Done, Job, Tokens
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
from provider.models.gemma4_assistant import load_assistant
from tests.helpers import collect, greedy, make_node, run

TEXT = "The cache keeps the keys. Once upon a time, a model read its prompt and wrote a story. "


@pytest.fixture(scope="module")
def demo():
    model, tok = load(str(DEMO_TARGET))
    return model, tok, load_assistant(DEMO_ASSISTANT)


def plain_greedy(model, prompt, n):
    return [t for t, _ in itertools.islice(generate_step(mx.array(prompt), model, max_tokens=n), n)]


def demo_prompts(tok) -> list[list[int]]:
    """Eight lengths: two cross the 128-token sliding window while decoding, two while reading the prompt."""
    ids = tok.encode(TEXT * 8)
    return [ids[i * 3:i * 3 + n] for i, n in enumerate([1, 4, 9, 30, 118, 126, 131, 160])]


def test_rows_of_one_round_accept_differently_join_and_leave_and_stay_exact(demo):
    model, tok, assistant = demo
    prompts, n = demo_prompts(tok), 32
    truth = [plain_greedy(model, p, n) for p in prompts]
    spec = Speculator(model, MTPDrafter(assistant, Target(model)))
    rows = [spec.new_row(p, stats=SpecStats("mtp", 3)) for p in prompts]
    for row in rows:
        while not spec.read(row, 48):
            pass
    out = [[first] for first in spec.begin(rows[:6])]  # the last two join three rounds later
    differing_rounds = 0
    for r in itertools.count():
        if r == 3:
            out += [[first] for first in spec.begin(rows[6:])]
        live = [i for i in range(len(out)) if len(out[i]) < n and not (i == 2 and r >= 4)]  # row 2 leaves
        if not live:
            break
        before = [rows[i].stats.accepted for i in live]
        for i, tokens in zip(live, spec.round([rows[i] for i in live])):
            out[i] += tokens
        accepted = {rows[i].stats.accepted - b for i, b in zip(live, before)}
        differing_rounds += len(accepted) > 1
    for i, (got, want) in enumerate(zip(out, truth)):
        assert got[:len(want)] == want[:len(got)], f"row {i} ({len(prompts[i])} prompt tokens)"
        assert len(got) >= n or i == 2
    assert differing_rounds >= 3, "rows in one round should accept different numbers of drafts"
    assert all(r.stats.batch_rows > r.stats.rounds for r in rows)  # every row shared its rounds


def test_eight_greedy_jobs_speculate_together_equal_their_solo_runs_and_one_is_cancelled(demo):
    _, tok, _ = demo
    prompts = [tok.decode(p) for p in demo_prompts(tok)]
    n, victim = 32, 4
    node = make_node({"demo": DEMO_TARGET}, max_concurrent_jobs=8, speculation="on",
                     manager_kw={"drafters": {"demo": DEMO_ASSISTANT}})

    async def cancelled_after_its_second_chunk(job: Job):
        ids = []
        async with node.run(job) as stream:
            async for ev in stream:
                if isinstance(ev, Tokens):
                    ids += ev.token_ids
                    if ev.seq == 1:
                        node.cancel(job.id)  # lands while the other rows' next round runs
                if isinstance(ev, Done):
                    return ids, "", ev, []

    async def main():
        solo = [(await collect(node, Job(f"solo{i}", "demo", greedy(n), prompt=p, speculation="off")))[0]
                for i, p in enumerate(prompts)]
        jobs = [Job(f"j{i}", "demo", greedy(n), prompt=p) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(cancelled_after_its_second_chunk(j) if i == victim else collect(node, j)
                                          for i, j in enumerate(jobs)))
        await node.stop()
        return solo, together

    solo, together = run(main())
    rates = set()
    for i, (want, (ids, _, done, _)) in enumerate(zip(solo, together)):
        spec = done.telemetry.speculation
        assert (spec.mode.value, spec.reason) == ("mtp", "ok"), i
        assert ids == want[:len(ids)], f"job {i} ({len(tok.encode(prompts[i]))} prompt tokens)"
        if i == victim:
            assert done.finish_reason == "cancelled" and 2 <= len(ids) < len(want)
            continue
        assert len(ids) == len(want), f"job {i}"
        assert spec.mean_batch > 2, spec  # verified together with the others
        rates.add(spec.acceptance_rate)
    assert len(rates) > 2  # each row kept its own acceptance
