"""Spot checks through the real wire: an honest node and a cheating one (other weights, served by the real node
code under the honest model's name and hash) take jobs from the reference coordinator, which verifies every
finished job on a third node and tallies each producer's verdicts. Sealed jobs are checked sealed."""

from __future__ import annotations

import asyncio
import contextlib

from coordinator_client.identity import Identity
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from tools.fixtures import cheats as cheat_fixtures
from tests.helpers import run, until
from tools.harness.nodes import harness


def _job(job_id: str, i: int) -> pb.JobRequest:
    sampling = pb.SamplingParams(temperature=0.0) if i % 2 == 0 else pb.SamplingParams(temperature=0.8, seed=i)
    return pb.JobRequest(job_id=job_id, model="m", max_tokens=24, sampling=sampling,
                         chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=f"Tell me {i} things")]))


def spot_checked(tmp_path, model: str, real, noisy, request, per_node: int) -> ReferenceCoordinator:
    """An honest node, a cheat (`noisy` under the honest weights' name and hash) and a verifier, all committing,
    under a reference coordinator that verifies every job on the third: `per_node` jobs to each of the first two
    (the last sealed), run until every verdict is in. Asserts the tallies: the honest passed, the cheat failed
    at token 0."""
    ids = {name: Identity.load_or_create(tmp_path / name).node_id for name in ("honest", "cheat", "verifier")}

    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200, verify_fraction=1.0, verify_seed=0)
        await coord.start()
        coord.spot_checks.verifiers = {ids["verifier"]}
        async with contextlib.AsyncExitStack() as stack:
            nodes = {}
            for name, path in (("honest", real), ("cheat", noisy), ("verifier", real)):
                _, nodes[name], _ = await stack.enter_async_context(
                    harness({model: path}, tmp_path / name, coordinator=coord, commitments="on"))
            await until(lambda: len(coord.sessions) == 3, "three sessions")
            await nodes["honest"].preload(model)
            await nodes["cheat"].preload(model)
            nodes["cheat"].model_hash = nodes["honest"].model_hash  # its wrong claim: the honest weights' hash
            sent = []
            for name in ("honest", "cheat"):
                for i in range(per_node):
                    job_id = f"{name}-{i}"
                    (coord.dispatch_sealed if i == per_node - 1 else coord.dispatch)(coord.sessions[ids[name]],
                                                                                      request(job_id, i))
                    sent.append(job_id)
            for job_id in sent:
                assert (await coord.outcome(job_id)).WhichOneof("frame") == "job_done", job_id
            await until(lambda: not coord.spot_checks.pending and sum(
                t.checked + t.errors for t in coord.spot_checks.tally.values()) == len(sent), "every verdict", 300)
            return coord

    coord = run(main())
    honest, cheat = coord.spot_checks.tally[ids["honest"]], coord.spot_checks.tally[ids["cheat"]]
    assert (honest.checked, honest.passed, honest.failed, honest.errors) == (per_node, per_node, 0, 0), honest
    assert (cheat.checked, cheat.failed, cheat.errors) == (per_node, per_node, 0), cheat
    assert all(f["first_failure"] == 0 for f in cheat.failures), cheat.failures
    return coord


def test_the_reference_coordinator_verifies_jobs_on_a_third_node_and_tallies_the_cheat(fixtures_dir, tmp_path):
    real = fixtures_dir / "gemma4-tiny"
    coord = spot_checked(tmp_path, "m", real, cheat_fixtures.noisy(real, tmp_path / "noisy", 0.01), _job, 4)
    assert not coord.bad_results
    # The verdicts came signed by the verifier, as every result.
    verdicts = [coord.outcomes[j][0].job_done for j in coord.outcomes if j.startswith("verify-")]
    assert len(verdicts) == 8 and all(d.signature and d.signature_layout == 3 for d in verdicts)
    # Each verdict says chunk by chunk where and by how much: the cheat's fail at their first chunk's entries.
    for d in verdicts:
        v = d.verdict
        assert len(v.per_chunk) == v.chunks >= 1 and [c.start for c in v.per_chunk] == [32 * i for i in range(v.chunks)]
        assert min(c.overlap for c in v.per_chunk) == v.min_overlap
        assert v.passed == (v.per_chunk[0].overlap >= 0.9 and v.per_chunk[0].mean_rel_err <= 0.003), v
