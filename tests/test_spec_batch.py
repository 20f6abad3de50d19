"""Speculation inside the batch: rows drafted and verified together, each with its own acceptance and
rollback, joining and leaving between rounds, on the trained demo pair (an MTP assistant that agrees with
its target often but not always) and a same-vocabulary draft model, checked against bare mlx-lm."""

import asyncio
import itertools

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from provider import speculation as sp
from provider.engine.proposers import MTPDrafter
from provider.engine.spec_rounds import Speculator
from provider.telemetry import SpecTelemetry
from provider.models.gemma4_target import Target
from provider.types import SpecReason
from provider.jobs import Job
from provider.outputs import Done, Tokens
from provider.drafters.gemma4_assistant import load_assistant
from provider.models.default import DEMO_ASSISTANT, DEMO_TARGET
from tests.helpers import collect, greedy, make_node, run

TEXT = "The cache keeps the keys. Once upon a time, a model read its prompt and wrote a story. "


@pytest.fixture(scope="module")
def demo(demo_f32):
    """The bundled pair in float32 (conftest's demo_f32): model, tokenizer, assistant, and the pair's paths."""
    model, tok = load(str(demo_f32[0]))
    return model, tok, load_assistant(demo_f32[1]), demo_f32


def plain_greedy(model, prompt, n):
    return [t for t, _ in itertools.islice(generate_step(mx.array(prompt), model, max_tokens=n), n)]


def demo_prompts(tok) -> list[list[int]]:
    """Eight lengths: two cross the 128-token sliding window while decoding, two while reading the prompt."""
    ids = tok.encode(TEXT * 8)
    return [ids[i * 3:i * 3 + n] for i, n in enumerate([1, 4, 9, 30, 118, 126, 131, 160])]


def test_rows_of_one_round_accept_differently_join_and_leave_and_stay_exact(demo):
    model, tok, assistant, _ = demo
    prompts, n = demo_prompts(tok), 32
    truth = [plain_greedy(model, p, n) for p in prompts]
    spec = Speculator(model, MTPDrafter(assistant, Target(model)))
    rows = [spec.new_row(p, stats=SpecTelemetry("mtp", k=3)) for p in prompts]
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
    _, tok, _, _ = demo
    prompts = [tok.decode(p) for p in demo_prompts(tok)]
    n, victim = 32, 4
    target, assistant = demo[3]
    node = make_node({"demo": target}, max_concurrent_jobs=8, speculation="on",
                     manager_kw={"drafters": {"demo": assistant}})

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


def test_auto_moves_its_speculating_row_to_the_plain_batch_when_a_second_job_makes_plain_pay(demo):
    """Under auto, a job alone speculates; when a second job arrives and two rows decode faster plain, the
    first leaves speculation with its caches and continues in the plain batch, token for token. The costs
    are a stand-in (named as such: fixed numbers for arithmetic-bound hardware, instead of timing this
    machine, whose noise would make the decision flaky): one row pays to speculate, two do not."""
    costs = sp.SpecCosts(0.010, (0.012, 0.016, 0.020, 0.024), rows=4, plain_rows_s=0.040,
                         round_rows_s=(0.120, 0.160, 0.200, 0.240))
    # The shipped pair: the second job must arrive while the first still speculates (float32 runs ~4x faster).
    node = make_node({"demo": DEMO_TARGET}, max_concurrent_jobs=4, manager_kw={"drafters": {"demo": DEMO_ASSISTANT}})
    node.models.profiler = lambda lm: sp.SpecProfile(costs, {sp.GREEDY: 0.9, sp.SPECULATIVE_SAMPLING: 0.9})
    first, second = "Once upon a time, a cache", "The model read its prompt and"

    async def main():
        solo = [(await collect(node, Job(f"solo{i}", "demo", greedy(n), prompt=p, speculation="off")))[0]
                for i, (p, n) in enumerate(((first, 96), (second, 24)))]
        started = asyncio.Event()

        async def alone_then_joined():
            ids = []
            async with node.run(Job("a", "demo", greedy(96), prompt=first)) as stream:
                async for ev in stream:
                    if isinstance(ev, Tokens):
                        ids += ev.token_ids
                        if len(ids) >= 6:
                            started.set()
                    if isinstance(ev, Done):
                        return ids, ev

        async def second_job():
            await started.wait()
            return await collect(node, Job("b", "demo", greedy(24), prompt=second))

        (a_ids, a_done), (b_ids, _, b_done, _) = await asyncio.gather(alone_then_joined(), second_job())
        queue = node.status().queue
        await node.stop()
        return solo, a_ids, a_done, b_ids, b_done, queue

    solo, a_ids, a_done, b_ids, b_done, queue = run(main())
    assert a_ids == solo[0] and b_ids == solo[1]
    a_spec = a_done.telemetry.speculation
    assert len(a_ids) == 96 and a_spec.mode.value == "mtp" and 1 <= a_spec.rounds
    assert a_spec.target_forwards < len(a_ids) / 2  # it speculated for a while, then decoded plain
    assert b_done.telemetry.speculation.reason == SpecReason.NOT_PROFITABLE
    assert queue.batch_rows > queue.batch_steps  # the plain batch decoded both rows together


def test_batch_too_large_is_reported_through_both_transports(fixtures_dir, tmp_path):
    """With speculation_max_batch = 1, a job that arrives while another runs on its model decodes plain, and
    both the local API and the coordinator's JobDone say why."""
    import httpx

    from tests.helpers import LocalServer
    from tools.harness.nodes import harness, job

    gemma, assistant = fixtures_dir / "gemma4-tiny", fixtures_dir / "gemma4-tiny-assistant"

    async def over_http(url: str, token: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
            bodies = [{"model": "gemma4-tiny", "prompt": f"cache {i} " * 20, "max_tokens": 40, "temperature": 0}
                      for i in range(3)]
            replies = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
        return [r.json()["telemetry"]["speculation"] for r in replies]

    (tmp_path / "http").mkdir()
    srv = LocalServer(gemma, tmp_path / "http", "--drafter", str(assistant),
                      env={"PROVIDER_SPECULATION_MAX_BATCH": "1"})
    try:
        reasons = {s["reason"] for s in run(over_http(srv.url, srv.token))}
    finally:
        assert srv.stop() == 0
    assert "batch_too_large" in reasons, reasons

    async def over_grpc() -> set[str]:
        async with harness({"g": gemma}, tmp_path / "grpc", manager_kw={"drafters": {"g": assistant}},
                           speculation_max_batch=1) as (coord, node, _):
            s = await coord.wait_for_node()
            for i in range(3):
                coord.dispatch(s, job(f"j{i}", "g", max_tokens=40, prompt=f"cache {i} " * 20))
            done = [(await coord.outcome(f"j{i}")).job_done for i in range(3)]
            assert all(d.telemetry.speculation.mode == "off" for d in done)
            return {d.telemetry.speculation.reason for d in done}

    assert "batch_too_large" in run(over_grpc())  # JobDone.telemetry.speculation.reason
