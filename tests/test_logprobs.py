"""Logprobs from the engine's own forwards, against mlx-lm's log-softmax of the same tokens (issue 22).

The reference is one teacher-forced mlx-lm forward over prompt + generated ids, in float32: the node's values
(from batched decode steps, speculative verify forwards and the chunked prefill of a scored prompt) must
agree within 2e-3, for greedy and sampled rows, plain and speculating, and whatever a logits processor or a
grammar did to the distribution the token was drawn from.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm import load

from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Tokens
from tests.helpers import collect, make_node, run

PROMPTS = ["The cache batch token prompt", "A model stream window", "prefix memory budget node server request"]
TOL = 2e-3
CHAT = ({"role": "user", "content": "Tell me about the cache"},)


def _reference(model, ids: list[int]) -> mx.array:
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _check_generated(model, tok, prompt, events, top: int) -> int:
    """Every emitted token's logprob and alternatives against the reference; returns how many were checked.
    `prompt`: raw text, or chat messages (templated as the node templates them)."""
    ids = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    lps = [lp for e in events if isinstance(e, Tokens) for lp in e.logprobs]
    prompt_ids = tok.encode(prompt) if isinstance(prompt, str) else \
        list(tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True))
    ref = _reference(model, prompt_ids + ids)
    assert [lp.token for lp in lps[:len(ids)]] == ids
    for i, lp in enumerate(lps[:len(ids)]):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(lp.logprob - row[lp.token].item()) < TOL, (i, lp.logprob, row[lp.token].item())
        assert len(lp.top) == top
        values = [v for _, _, v, _ in lp.top]
        assert values == sorted(values, reverse=True)
        for token_id, _, v, _ in lp.top:
            assert abs(v - row[token_id].item()) < TOL
        if top:  # the best alternative is the model's argmax
            assert abs(values[0] - mx.max(row).item()) < TOL
    return len(ids)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_rows_report_the_models_own_logprobs(fixtures_dir, temperature):
    path = fixtures_dir / "llama-tiny"
    model, tok = load(str(path))

    async def main():
        node = make_node({"m": path}, max_concurrent_jobs=8)
        # Three rows in one batch; one with a logit bias (a processor), whose logprobs stay the model's own.
        jobs = [Job(id=f"j{i}", model="m", prompt=p,
                    sampling=SamplingParams(max_tokens=12, temperature=temperature, seed=7 + i, logprobs=3,
                                            logit_bias=((443, 5.0),) if i == 2 else ()))
                for i, p in enumerate(PROMPTS)]
        jobs.append(Job(id="chat", model="m", messages=CHAT,
                        sampling=SamplingParams(max_tokens=12, temperature=temperature, seed=1, logprobs=3)))
        results = await asyncio.gather(*(collect(node, j) for j in jobs))
        await node.stop()
        return results

    results = run(main())
    for prompt, (ids, _, end, events) in zip([*PROMPTS, CHAT], results):
        assert isinstance(end, Done), end
        assert _check_generated(model, tok, prompt, events, 3) == len(ids) > 0
        if temperature == 0.0:  # greedy: each token is the top alternative
            lps = [lp for e in events if isinstance(e, Tokens) for lp in e.logprobs]
            biased = prompt == PROMPTS[2]
            assert biased or all(lp.top[0][0] == lp.token for lp in lps)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_rounds_report_the_targets_logprobs(fixtures_dir, temperature):
    path = fixtures_dir / "llama-tiny"
    model, tok = load(str(path))

    async def main():
        node = make_node({"m": path}, speculation="on", speculation_k=3,
                         manager_kw={"drafters": {"m": fixtures_dir / "llama-tiny-draft"}})
        out = await asyncio.gather(*(collect(node, Job(id=f"s{i}", model="m", prompt=p,
                                                      sampling=SamplingParams(max_tokens=16, temperature=temperature,
                                                                              seed=3, logprobs=2)))
                                     for i, p in enumerate(PROMPTS[:2])))
        await node.stop()
        return out

    for prompt, (ids, _, end, events) in zip(PROMPTS, run(main())):
        assert isinstance(end, Done), end
        assert end.telemetry.speculation.mode != "off" and end.telemetry.speculation.rounds > 0
        assert _check_generated(model, tok, prompt, events, 2) == len(ids) > 0


def test_a_scored_prompt_equals_a_plain_forward_and_scoring_alone_generates_nothing(fixtures_dir):
    path = fixtures_dir / "llama-tiny"
    model, tok = load(str(path))
    long = " ".join(PROMPTS * 12)  # several prefill chunks at prefill_step_size 32

    async def main():
        node = make_node({"m": path}, prefill_step_size=32)
        scored = [Job(id=f"p{i}", model="m", prompt=p,
                      sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, prompt_logprobs=True))
                  for i, (p, max_tokens) in enumerate([(long, 4), (PROMPTS[0], 0)])]
        plain = Job(id="beside", model="m", prompt=PROMPTS[1], sampling=SamplingParams(max_tokens=24, temperature=0.0))
        out = await asyncio.gather(*(collect(node, j) for j in [*scored, plain]))
        await node.stop()
        return out

    (ids, _, end, events), (ids0, _, end0, _), (_, _, beside, _) = run(main())
    assert isinstance(beside, Done) and beside.usage.completion_tokens == 24
    for prompt, done in ((long, end), (PROMPTS[0], end0)):
        prompt_ids = tok.encode(prompt)
        ref = _reference(model, prompt_ids)
        scored = done.prompt_logprobs
        assert [lp.token for lp in scored] == prompt_ids and scored[0].logprob is None
        for i, lp in enumerate(scored[1:], 1):
            assert abs(lp.logprob - ref[i - 1, prompt_ids[i]].item()) < TOL, i
            assert lp.top[0][0] == mx.argmax(ref[i - 1]).item()
        assert done.usage.cached_prompt_tokens == 0  # read whole: every position's logits were wanted
    first = next(e for e in events if isinstance(e, Tokens))
    assert first.prompt_logprobs == end.prompt_logprobs  # streamed clients get them before the text
    assert len(ids) == 4 and _check_generated(model, tok, long, events, 1) == 4
    assert ids0 == [] and end0.usage.completion_tokens == 0 and end0.finish_reason == "length"


def test_prompt_ids_outside_the_vocabulary_are_refused_at_the_edge(fixtures_dir):
    path = fixtures_dir / "llama-tiny"

    async def main():
        node = make_node({"m": path})
        out = [await collect(node, Job(id=f"v{i}", model="m", prompt_ids=ids, sampling=SamplingParams(max_tokens=2)))
               for i, ids in enumerate([(1, 5, 1 << 40), (1, 511), (1, 512)])]
        await node.stop()
        return out

    bad, good, edge = run(main())
    assert bad[2].cause == "invalid_request" and bad[2].param == "prompt"
    assert isinstance(good[2], Done)
    assert edge[2].cause == "invalid_request" and "512" in edge[2].message


def test_a_large_vocabulary_scores_in_chunks_its_scratch_bound_holds(fixtures_dir):
    """Scoring computes logits at every prompt position (a plain prefill never does): with a large vocabulary a
    chunk is cut so they stay within SCORE_SCRATCH_BYTES, and the result does not change."""
    from provider.engine.logprobs import SCORE_SCRATCH_BYTES, PromptScorer, score_chunk, texts_for

    model, tok = load(str(fixtures_dir / "llama-tiny"))
    ids = tok.encode(" ".join(PROMPTS * 4))
    assert score_chunk(512, 1 << 18) == 16 and score_chunk(512, 512) == 512 and score_chunk(8, 1 << 40) == 1
    assert 16 * (1 << 18) * 16 <= SCORE_SCRATCH_BYTES
    whole = PromptScorer(model, ids, 2, texts_for(tok), n_vocab=512)
    cut = PromptScorer(model, ids, 2, texts_for(tok), n_vocab=1 << 18)  # as if the vocabulary were Gemma's
    whole.step(512)
    steps = 0
    while not cut.done:
        cut.step(512)
        steps += 1
    assert whole.done and steps == -(-(len(ids) - 1) // 16)
    assert [lp.token for lp in cut.logprobs] == ids
    for a, b in zip(whole.logprobs[1:], cut.logprobs[1:]):
        assert abs(a.logprob - b.logprob) < TOL and [t for t, *_ in a.top] == [t for t, *_ in b.top]
