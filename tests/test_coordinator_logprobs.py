"""Logprobs and token-id prompts over the coordinator session (issue 22): JobRequest.prompt_ids, .logprobs and
.prompt_logprobs; each chunk's logprobs, the prompt's on chunk 0, the whole of both on a re-sent outcome,
sealed like the rest. Against the reference coordinator on loopback; values checked against mlx-lm."""

import mlx.core as mx
from mlx_lm import load

from coordinator_client.pb import provider_pb2 as pb
from tests.helpers import run, until
from tools.harness.nodes import harness

TOL = 2e-3


def _request(job_id: str, ids: list[int], **kw) -> pb.JobRequest:
    return pb.JobRequest(job_id=job_id, model="m", prompt_ids=pb.PromptTokens(ids=ids), max_tokens=6,
                         sampling=pb.SamplingParams(temperature=0.0), **kw)


def test_logprobs_ride_on_chunks_and_outcomes_plain_and_sealed(fixtures_dir, tmp_path):
    path = fixtures_dir / "llama-tiny"
    model, tok = load(str(path))
    ids = tok.encode("The cache batch token prompt")

    async def main():
        async with harness({"m": path}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, _request("clear", ids, logprobs=2, prompt_logprobs=True))
            coord.dispatch_sealed(s, _request("sealed", ids, logprobs=2, prompt_logprobs=True))
            coord.dispatch(s, _request("no-top", ids, logprobs=0))
            coord.dispatch(s, _request("bare", ids))
            for job_id in ("clear", "sealed", "no-top", "bare"):
                assert (await coord.outcome(job_id)).HasField("job_done"), job_id
            wire = [f.token_chunk for _, kind, f in coord.frames if kind == "token_chunk"
                    and f.token_chunk.job_id == "sealed"]
            assert wire and all(c.sealed and not c.logprobs and not c.prompt_logprobs for c in wire)
            # A repeat: the stored outcome, sent again whole.
            coord.dispatch(s, _request("clear", ids, logprobs=2, prompt_logprobs=True))
            await until(lambda: len(coord.outcomes["clear"]) >= 2, "the repeat got no outcome")
            bad = {"needs-logprobs": _request("needs-logprobs", ids, prompt_logprobs=True),
                   "too-many": _request("too-many", ids, logprobs=21),
                   "past-vocab": _request("past-vocab", [1, 1 << 30], logprobs=1)}
            for job_id, req in bad.items():
                coord.dispatch(s, req)
                err = (await coord.outcome(job_id)).job_error
                assert err.cause == pb.ERROR_CAUSE_INVALID_REQUEST, (job_id, err)
            return {j: list(coord.chunks[j]) for j in ("clear", "sealed", "no-top", "bare")}, coord.outcomes["clear"]

    chunks, outcomes = run(main())
    full = ids + [t for c in chunks["clear"] for t in c.token_ids]
    logits = model(mx.array(full)[None])[0].astype(mx.float32)
    ref = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for job_id in ("clear", "sealed"):
        cs = chunks[job_id]
        assert [t for c in cs for t in c.token_ids] == full[len(ids):]  # greedy: the same tokens either way
        prompt = list(cs[0].prompt_logprobs)
        assert [p.token for p in prompt] == ids and not prompt[0].HasField("logprob")
        for i, p in enumerate(prompt[1:], 1):
            assert abs(p.logprob - ref[i - 1, ids[i]].item()) < TOL
        generated = [lp for c in cs for lp in c.logprobs]
        for i, lp in enumerate(generated[:len(full) - len(ids)]):
            row = ref[len(ids) - 1 + i]
            assert abs(lp.logprob - row[lp.token].item()) < TOL and len(lp.top) == 2
            assert lp.top[0].token == mx.argmax(row).item()
    assert all(len(lp.top) == 0 for c in chunks["no-top"] for lp in c.logprobs)
    assert all(not c.logprobs and not c.prompt_logprobs for c in chunks["bare"])
    assert len(outcomes) == 2  # the repeat got the stored outcome, with the whole completion this time
    resent = outcomes[-1].job_done.completion
    assert [p.token for p in resent.prompt_logprobs] == ids
    assert [lp.logprob for lp in resent.logprobs] == [lp.logprob for c in chunks["clear"] for lp in c.logprobs]
    assert not outcomes[0].job_done.completion.logprobs  # first sent brief: the chunks carried them
