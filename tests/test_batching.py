"""The batched engine: many jobs in one forward, chunked prefill between decode steps, prefix reuse, and
per-job memory admission, driven in-process with real fixture models and checked against bare mlx-lm."""

import asyncio

import pytest

from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Error, Tokens
from provider.types import Cause
from tests import reference
from tests.helpers import collect, greedy, make_node, run

WORDS = "cache batch token prompt model stream window prefix memory budget".split()


def _prompt(n_words: int, salt: int) -> str:
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n_words))


# Eight mixed lengths; on gemma4-tiny (a 32-token window) most run past the window before generation ends.
LENGTHS = [3, 11, 40, 70, 6, 25, 90, 1]


@pytest.mark.parametrize("family", ["gemma4-tiny", "llama-tiny"])
def test_a_batch_of_eight_equals_each_solo_run(fixtures_dir, family):
    path = fixtures_dir / family
    node = make_node({family: path}, max_concurrent_jobs=8, speculation="off")
    prompts = [_prompt(n, i) for i, n in enumerate(LENGTHS)]

    async def main():
        results = await asyncio.gather(*(collect(node, Job(f"j{i}", family, greedy(24), prompt=p))
                                         for i, p in enumerate(prompts)))
        for i, (ids, text, done, _) in enumerate(results):
            expected, expected_text = reference.greedy(path, prompts[i], 24)
            assert ids == expected, f"row {i} ({LENGTHS[i]} words) diverged from its solo run"
            assert text == expected_text
            assert done.telemetry.speculation.reason == "policy_off"
        q = node.status().queue
        assert q.batch_rows / q.batch_steps > 2, q  # they really decoded together
        await node.stop()

    run(main())


def test_jobs_for_two_models_run_in_their_own_batches_side_by_side(fixtures_dir):
    paths = {"l": fixtures_dir / "llama-tiny", "q": fixtures_dir / "qwen3-tiny"}
    node = make_node(paths, max_concurrent_jobs=8)
    jobs = [(f"{m}{i}", m, _prompt(6 + 13 * i, i)) for m in paths for i in range(3)]

    async def main():
        results = await asyncio.gather(*(collect(node, Job(j, m, greedy(16), prompt=p)) for j, m, p in jobs))
        for (job_id, m, p), (ids, _, _, _) in zip(jobs, results):
            assert ids == reference.greedy_tokens(paths[m], p, 16), job_id
        await node.stop()

    run(main())


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(fixtures_dir):
    node = make_node({"q": fixtures_dir / "qwen3-tiny"}, max_concurrent_jobs=8)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)

    async def main():
        alone, _, _, _ = await collect(node, Job("alone", "q", seeded, prompt="The cache"))
        others = [collect(node, Job(f"o{i}", "q", SamplingParams(max_tokens=30, temperature=1.0) if i % 2 else
                                    greedy(30), prompt=_prompt(5 + 9 * i, i))) for i in range(5)]
        crowded, *_ = await asyncio.gather(collect(node, Job("crowded", "q", seeded, prompt="The cache")), *others)
        assert crowded[0] == alone
        await node.stop()

    run(main())


def test_a_cancelled_row_leaves_the_others_exact(fixtures_dir):
    path = fixtures_dir / "llama-tiny"
    node = make_node({"l": path}, max_concurrent_jobs=8, speculation="off")
    prompts = [_prompt(8 + 5 * i, i) for i in range(4)]

    async def main():
        async def cancel_after_three():
            async with node.run(Job("victim", "l", greedy(64), prompt=prompts[0])) as stream:
                n = 0
                async for ev in stream:
                    if isinstance(ev, Tokens):
                        n += 1
                        if n == 3:
                            node.cancel("victim")
                    if isinstance(ev, Done):
                        return ev

        victim, *rest = await asyncio.gather(cancel_after_three(), *(
            collect(node, Job(f"r{i}", "l", greedy(32), prompt=p)) for i, p in enumerate(prompts[1:])))
        assert victim.finish_reason == "cancelled" and victim.usage.completion_tokens < 10
        for (ids, _, _, _), p in zip(rest, prompts[1:]):
            assert ids == reference.greedy_tokens(path, p, 32)
        await node.stop()

    run(main())


def test_a_stream_keeps_decoding_while_a_long_prompt_prefills(fixtures_dir):
    """Prefill goes in chunks with decode steps between them: counted in tokens, not timed."""
    node = make_node({"l": fixtures_dir / "llama-tiny"}, max_concurrent_jobs=4, prefill_step_size=16,
                     speculation="off")
    long_prompt = _prompt(120, 3)

    async def main():
        log: list[tuple[str, str]] = []  # (job, event kind), in arrival order
        tokens_at: list[int] = []  # the stream's token count when each entry was logged

        async def watch(job):
            async with node.run(job) as stream:
                async for ev in stream:
                    assert not isinstance(ev, Error), ev
                    if isinstance(ev, Tokens) and job.id == "stream":
                        tokens_at.append((tokens_at[-1] if tokens_at else 0) + len(ev.token_ids))
                    else:
                        tokens_at.append(tokens_at[-1] if tokens_at else 0)
                    log.append((job.id, type(ev).__name__))

        no_eos = tuple((t, -100.0) for t in reference.load_cached(str(fixtures_dir / "llama-tiny"))[1].eos_token_ids)
        endless = SamplingParams(max_tokens=600, temperature=0.0, logit_bias=no_eos)
        streaming = asyncio.create_task(watch(Job("stream", "l", endless, prompt="The cache")))
        while ("stream", "Tokens") not in log:
            await asyncio.sleep(0.01)
        await watch(Job("long", "l", greedy(2), prompt=long_prompt))
        node.cancel("stream")
        await streaming
        accepted = log.index(("long", "Accepted"))
        first = log.index(("long", "Tokens"))
        during = tokens_at[first] - tokens_at[accepted]  # stream tokens (events may coalesce several)
        prompt_tokens = len(reference.load_cached(str(fixtures_dir / "llama-tiny"))[1].encode(long_prompt))
        chunks = prompt_tokens // 16
        assert chunks >= 10
        assert during >= chunks - 2, (during, chunks)  # a decode step between every two chunks
        await node.stop()

    run(main())


@pytest.mark.parametrize("family", ["gemma4-tiny", "llama-tiny"])
def test_a_shared_system_prompt_is_computed_once(fixtures_dir, family):
    path = fixtures_dir / family
    node = make_node({family: path}, max_concurrent_jobs=4, speculation="off")
    system = {"role": "system", "content": _prompt(120, 1)}  # far past gemma4-tiny's 32-token window

    async def main():
        cached = []
        for i, question in enumerate(["What is a cache?", "Why batch?", "Name a window."]):
            messages = (system, {"role": "user", "content": question})
            ids, _, done, events = await collect(node, Job(f"c{i}", family, greedy(16), messages=messages))
            assert ids == reference.greedy_tokens(path, reference.chat_ids(path, list(messages)), 16)
            assert done.usage.cached_prompt_tokens == done.telemetry.cached_prompt_tokens
            cached.append(done.usage.cached_prompt_tokens)
            assert cached[-1] < events[0].prompt_tokens
        assert cached[0] == 0 and cached[1] > 100 and cached[2] >= cached[1], cached
        assert node.status().memory.prefix_cache_bytes > 0
        await node.stop()

    run(main())


def test_a_repeated_raw_prompt_reuses_the_finished_jobs_kv(fixtures_dir):
    path = fixtures_dir / "llama-tiny"
    node = make_node({"l": path}, speculation="off")
    prompt = _prompt(60, 2)

    async def main():
        first, _, d1, _ = await collect(node, Job("a", "l", greedy(8), prompt=prompt))
        again, _, d2, _ = await collect(node, Job("b", "l", greedy(8), prompt=prompt + " window"))
        assert d1.usage.cached_prompt_tokens == 0 and d2.usage.cached_prompt_tokens >= 60
        assert again == reference.greedy_tokens(path, prompt + " window", 8)
        await node.stop()

    run(main())


def _kv_bytes(node, model, tokens):
    return node.models.job_kv_bytes(model, tokens)


def test_jobs_whose_kv_does_not_fit_wait_and_one_that_never_fits_is_refused(fixtures_dir):
    path = fixtures_dir / "llama-tiny"
    probe = make_node({"l": path})
    no_eos = tuple((t, -100.0) for t in reference.load_cached(str(path))[1].eos_token_ids)
    long_job = SamplingParams(max_tokens=200, temperature=0.0, logit_bias=no_eos)

    async def sizes():
        _, _, done, events = await collect(probe, Job("p", "l", greedy(1), prompt="x"))
        held = probe.status().memory.models_bytes
        per_job = _kv_bytes(probe, "l", events[0].prompt_tokens + 200)
        await probe.stop()
        return held, per_job

    held, per_job = run(sizes())
    # Room for one such job at a time, not two; the load gate asks for one 16-token sequence.
    node = make_node({"l": path}, budget_bytes=held + int(1.5 * per_job), max_concurrent_jobs=8,
                     speculation="off", prefix_cache_gb=0, manager_kw={"kv_reserve_tokens": 16})

    async def main():
        log: list[tuple[str, str]] = []

        async def watch(job):
            async with node.run(job) as stream:
                async for ev in stream:
                    log.append((job.id, type(ev).__name__))
                    end = ev
            return end

        ends = await asyncio.gather(*(watch(Job(f"w{i}", "l", long_job, prompt="x")) for i in range(3)))
        assert all(isinstance(e, Done) and e.usage.completion_tokens == 200 for e in ends), ends
        starts = sorted(log.index((f"w{i}", "Accepted")) for i in range(3))
        finishes = sorted(log.index((f"w{i}", "Done")) for i in range(3))
        assert starts[1] > finishes[0] and starts[2] > finishes[1], "two jobs held KV the budget has room for once"
        _, _, err, _ = await collect(node, Job("huge", "l", greedy(4000), prompt="x"))
        assert isinstance(err, Error) and err.cause == Cause.INSUFFICIENT_MEMORY, err
        assert "MiB" in err.message and "max_tokens" in err.message
        ids, _, ok, _ = await collect(node, Job("after", "l", greedy(4), prompt="x"))
        assert isinstance(ok, Done)
        assert node.status().memory.jobs_kv_bytes == 0
        await node.stop()

    run(main())


def test_prompts_arriving_together_are_read_one_after_another(fixtures_dir):
    """First come, first served, each prompt to its end (engine.prefill_plan): the first of three long prompts
    submitted at once decodes while the others are read, rather than all three being read side by side and
    starting together. Counted in tokens, not timed."""
    node = make_node({"l": fixtures_dir / "llama-tiny"}, max_concurrent_jobs=4, prefill_step_size=16,
                     speculation="off")
    no_eos = tuple((t, -100.0) for t in reference.load_cached(str(fixtures_dir / "llama-tiny"))[1].eos_token_ids)
    params = SamplingParams(max_tokens=200, temperature=0.0, logit_bias=no_eos)

    async def main():
        log: list[tuple[str, int]] = []  # (job, its tokens so far) at each Tokens event, in arrival order

        async def watch(job):
            count = 0
            async with node.run(job) as stream:
                async for ev in stream:
                    assert not isinstance(ev, Error), ev
                    if isinstance(ev, Tokens):
                        count += len(ev.token_ids)
                        log.append((job.id, count))

        await asyncio.gather(*(watch(Job(name, "l", params, prompt=_prompt(100, salt)))
                               for salt, name in enumerate("abc")))
        # whichever prompt was ready first is read first; the first to start decodes while the other two are read
        firsts = sorted((next(i for i, (job, _) in enumerate(log) if job == name), name) for name in "abc")
        (_, first), _, (last_at, _) = firsts
        before_last = max(count for job, count in log[:last_at] if job == first)
        tokenizer = reference.load_cached(str(fixtures_dir / "llama-tiny"))[1]
        shortest = min(len(tokenizer.encode(_prompt(100, salt))) for salt in range(3))
        # a token in every step that reads the other two prompts: 2 prompts of >= shortest // 16 steps each
        assert before_last >= 2 * (shortest // 16) - 2, (before_last, shortest)
        await node.stop()

    run(main())
