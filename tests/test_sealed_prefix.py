"""A sealed prompt cannot be read back through the prefix cache (issue 56), through the real wire.

Before: a sealed job was kept under the same scope as an unsealed job of its `cache_scope`, and usage's
`cached_prompt_tokens` went out in the clear, so unsealed probes sharing its first ids were a token-exact oracle
(cached 200 for a 200-id match, 0 for a wrong first id). Now nothing a sealed job leaves behind is kept, and a
sealed job is served nothing kept, so neither side can tell what the other's prompt began with."""

from __future__ import annotations

import random

from coordinator_client.pb import provider_pb2 as pb
from tests.helpers import run, until
from tools.harness.nodes import harness


def _request(job_id: str, ids: list[int], scope: str) -> pb.JobRequest:
    return pb.JobRequest(job_id=job_id, model="m", max_tokens=4, sampling=pb.SamplingParams(temperature=0.0),
                         prompt_ids=pb.PromptTokens(ids=ids), cache_scope=scope)


def test_a_sealed_prompt_leaves_nothing_an_unsealed_or_sealed_probe_can_find(fixtures_dir, tmp_path):
    rng = random.Random(56)
    secret = [rng.randrange(3, 250) for _ in range(300)]
    public = [rng.randrange(3, 250) for _ in range(300)]

    async def main():
        async with harness({"m": fixtures_dir / "llama-tiny"}, tmp_path / "n") as (coord, node, _):
            await until(lambda: coord.sessions, "a session")
            s = next(iter(coord.sessions.values()))

            async def cached(job_id: str, ids: list[int], sealed: bool, scope: str = "tenant-a") -> int:
                (coord.dispatch_sealed if sealed else coord.dispatch)(s, _request(job_id, ids, scope))
                frame = await coord.outcome(job_id)
                assert frame.WhichOneof("frame") == "job_done", frame
                return frame.job_done.usage.cached_prompt_tokens

            out = {}
            for n in (200, 120, 40):  # an unsealed probe sharing the sealed prompt's first n ids, then a free tail,
                scope = f"tenant-{n}"  # in the sealed job's scope (one each: a probe keeps its own prompt)
                out[f"sealed {n}"] = await cached(f"sealed-{n}", secret, True, scope)
                out[f"probe {n}"] = await cached(f"probe-{n}", secret[:n] + public[:100], False, scope)
            out["probe no scope"] = await cached("probe-x", secret[:200] + public[:100], False, "")
            # The other way: an unsealed prompt kept, then sealed jobs that share its prefix are served nothing.
            out["public"] = await cached("public", public, False, "tenant-p")
            out["public again"] = await cached("public-again", public[:250] + secret[:20], False, "tenant-p")
            out["sealed probe"] = await cached("sealed-probe", public[:250] + secret[:30], True, "tenant-p")
            out["sealed twice"] = await cached("sealed-twice", secret, True, "tenant-200")
            return out

    out = run(main())
    assert out["public again"] >= 200, out  # the cache works for unsealed jobs of one scope: the probes can tell
    assert {k: v for k, v in out.items() if k != "public again"} == dict.fromkeys(out.keys() - {"public again"}, 0), \
        out


def test_a_sealed_answer_tells_its_length_only_to_the_bucket_and_no_speculation(fixtures_dir, tmp_path):
    """Found by a review outside the tests: a sealed chunk's ciphertext was its text's length + 16, so a coordinator
    that ran a guessed prompt in the clear matched the sealed job's chunk lengths one by one (and its speculation
    counts, sent in the clear). Now every sealed body (chunk and completion) is padded to 256 bytes, and a sealed
    job's telemetry says nothing of its drafts."""
    from coordinator_client.sealing import SEALED_CHUNK_BUCKET

    async def main():
        async with harness({"m": fixtures_dir / "llama-tiny"}, tmp_path / "n") as (coord, node, _):
            await until(lambda: coord.sessions, "a session")
            s = next(iter(coord.sessions.values()))
            for i, n in enumerate((1, 3, 9)):
                request = _request(f"sealed-{i}", [5 + i] * 20, "")
                request.max_tokens = n
                coord.dispatch_sealed(s, request)
                await coord.outcome(f"sealed-{i}")
            return [f for _, kind, f in coord.frames if kind in ("token_chunk", "job_done")]

    frames = run(main())
    overhead = 16  # the AEAD's tag
    chunks = [f.token_chunk.sealed for f in frames if f.WhichOneof("frame") == "token_chunk"]
    dones = [f.job_done for f in frames if f.WhichOneof("frame") == "job_done"]
    assert chunks and len(dones) == 3
    assert all((len(c) - overhead) % SEALED_CHUNK_BUCKET == 0 for c in chunks), sorted({len(c) for c in chunks})
    # The whole completion is sealed on a resend (empty on the session that streamed the chunks): padded alike.
    assert all((len(d.completion.sealed) - overhead) % SEALED_CHUNK_BUCKET == 0 for d in dones if d.completion.sealed)
    assert not any(d.telemetry.HasField("speculation") for d in dones)
