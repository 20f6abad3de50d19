"""The node's one job path, driven in-process with real fixture models."""

import asyncio

import pytest

from provider.jobs import Job, SamplingParams
from provider.outputs import Accepted, Done, Error, Tokens
from provider.types import Cause
from tests import reference
from tests.helpers import collect, drain, first_token, greedy, make_node, paused_models, run, until

PROMPTS = [
    [{"role": "user", "content": "What is a cache?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain speculation."}],
    [{"role": "user", "content": "def generate(prompt):"}],
    [{"role": "user", "content": "Café 日本語 🙂 " * 6}],  # longer than the 32-token sliding window
]


@pytest.mark.parametrize("family", ["gemma4-tiny", "llama-tiny"])
def test_greedy_tokens_equal_mlx_lm(fixtures_dir, family):
    path = fixtures_dir / family
    node = make_node({family: path})

    async def main():
        for i, messages in enumerate(PROMPTS):
            ids, text, done, _ = await collect(node, Job(f"j{i}", family, greedy(48), messages=tuple(messages)))
            expected, expected_text = reference.greedy(path, reference.chat_ids(path, messages), 48)
            assert ids == expected, f"prompt {i} diverged"
            assert done.usage.completion_tokens == len(expected)
            assert text == expected_text
        await node.stop()

    run(main())


def test_events_are_ordered_and_telemetry_complete(fixtures_dir):
    node = make_node({"q": fixtures_dir / "qwen3-tiny"})

    async def main():
        _, _, done, events = await collect(node, Job("a", "q", greedy(12), prompt="hello"))
        assert isinstance(events[0], Accepted) and events[0].prompt_tokens > 0
        seqs = [e.seq for e in events if isinstance(e, Tokens)]
        assert seqs == list(range(len(seqs)))
        assert isinstance(done, Done) and done.finish_reason == "length"
        t = done.telemetry
        assert t.ttft_ms > 0 and t.prefill_tokens_per_s > 0 and t.decode_tokens_per_s > 0
        assert t.speculation.as_dict() == {"mode": "off", "reason": "not_mtp_capable"}  # qwen3 has no drafter
        await node.stop()

    run(main())


def test_stop_strings_and_stop_token_ids(fixtures_dir):
    path = fixtures_dir / "gemma4-tiny"
    node = make_node({"g": path})

    async def main():
        ids, text, done, _ = await collect(node, Job("a", "g", greedy(30), prompt="The cache"))
        assert done.finish_reason == "length" and len(text) > 4
        # Stop on a string taken from the middle of the unconstrained output.
        stop = text[3:5]
        _, cut, done2, _ = await collect(node, Job("b", "g", greedy(30, stop=(stop,)), prompt="The cache"))
        assert done2.finish_reason == "stop" and cut == text[: text.index(stop)]
        # Stop on a token id: generation ends before that token.
        _, _, done3, _ = await collect(node, Job("c", "g", greedy(30, stop_token_ids=(ids[5],)), prompt="The cache"))
        assert done3.finish_reason == "stop" and done3.usage.completion_tokens == ids.index(ids[5])
        await node.stop()

    run(main())


def test_seeded_sampling_is_reproducible_and_isolated(fixtures_dir):
    node = make_node({"g": fixtures_dir / "gemma4-tiny"}, max_concurrent_jobs=4)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)

    async def main():
        solo, *_ = await collect(node, Job("a", "g", params, prompt="hello"))
        # The same seed interleaved with other sampling jobs gives the same tokens.
        others = [collect(node, Job(f"o{i}", "g", SamplingParams(max_tokens=24), prompt="x")) for i in range(2)]
        results = await asyncio.gather(collect(node, Job("b", "g", params, prompt="hello")), *others)
        assert results[0][0] == solo
        different, *_ = await collect(node, Job("c", "g", SamplingParams(max_tokens=24, seed=99), prompt="hello"))
        assert different != solo
        await node.stop()

    run(main())


def test_cancel_stops_within_one_step(fixtures_dir):
    node = make_node({"g": fixtures_dir / "gemma4-tiny"})

    async def main():
        job = Job("a", "g", greedy(500), prompt="hello")
        stream = node.run(job)
        seen = 0
        async for ev in stream:
            if isinstance(ev, Tokens):
                seen += 1
                if seen == 3:
                    node.engine.cancel(job.id)
                    node.engine.cancel(job.id)  # a second cancel is harmless
            if isinstance(ev, Done):
                break
        assert ev.finish_reason == "cancelled"
        # At most the one step already under way when the cancel arrived.
        assert ev.usage.completion_tokens <= seen + 1
        await until(lambda: node.engine.stats.active == 0, "the cancelled job still counts as active")
        # The node keeps serving.
        _, _, done, _ = await collect(node, Job("b", "g", greedy(4), prompt="hi"))
        assert done.finish_reason == "length"
        await node.stop()

    run(main())


def test_closing_the_stream_cancels_the_job(fixtures_dir):
    node = make_node({"g": fixtures_dir / "gemma4-tiny"})

    async def main():
        async with node.run(Job("a", "g", greedy(500), prompt="hello")) as stream:
            async for ev in stream:
                if isinstance(ev, Tokens):
                    break  # the client went away
        await until(lambda: node.engine.stats.active == 0, "the job outlived its stream")
        assert node.engine.stats.jobs_cancelled == 1
        await node.stop()

    run(main())


def test_typed_errors_and_node_keeps_serving(fixtures_dir):
    node = make_node({"g": fixtures_dir / "gemma4-tiny", "broken": fixtures_dir / "missing-dir"})

    async def main():
        cases = [
            (Job("a", "nope", greedy(4), prompt="x"), Cause.UNKNOWN_MODEL),
            (Job("b", "g", greedy(4), prompt="word " * 2000), Cause.CONTEXT_LENGTH_EXCEEDED),
            (Job("c", "broken", greedy(4), prompt="x"), Cause.UNKNOWN_MODEL),
        ]
        for job, cause in cases:
            _, _, end, _ = await collect(node, job)
            assert isinstance(end, Error) and end.cause == cause, end
            assert end.message
        _, _, done, _ = await collect(node, Job("ok", "g", greedy(4), prompt="x"))
        assert isinstance(done, Done)
        await node.stop()

    run(main())


def test_concurrent_jobs_all_complete_and_overflow_is_typed(fixtures_dir):
    node = make_node({"g": fixtures_dir / "gemma4-tiny"}, max_concurrent_jobs=2, max_queued_jobs=3)

    async def main():
        jobs = [collect(node, Job(f"j{i}", "g", greedy(6), prompt=f"prompt {i}")) for i in range(8)]
        results = await asyncio.gather(*jobs)
        ends = [r[2] for r in results]
        done = [e for e in ends if isinstance(e, Done)]
        overloaded = [e for e in ends if isinstance(e, Error) and e.cause == Cause.OVERLOADED]
        assert len(done) + len(overloaded) == 8
        # Two run, three wait, the rest are refused at once with a typed cause.
        assert len(done) == 5 and len(overloaded) == 3
        assert all(d.finish_reason == "stop" or d.usage.completion_tokens == 6 for d in done)
        await node.stop()

    run(main())


def test_stop_cancels_in_flight_after_grace(fixtures_dir, monkeypatch):
    node = make_node({"g": fixtures_dir / "gemma4-tiny"})
    paused = paused_models(monkeypatch)

    async def main():
        running = node.run(Job("a", "g", greedy(1000), prompt="x"))
        await first_token(running)
        paused.add("g")  # it cannot end on its own: only the stop ends it
        await node.stop(grace_s=0.2)
        end = (await asyncio.wait_for(drain(running), 60))[-1]  # the bounds only catch a hang
        assert isinstance(end, Done) and end.finish_reason == "cancelled"
        # A job submitted after stop gets a typed refusal, not a hang.
        _, _, late, _ = await asyncio.wait_for(collect(node, Job("b", "g", greedy(2), prompt="x")), 60)
        assert isinstance(late, Error) and late.cause == Cause.DRAINING

    run(main())
