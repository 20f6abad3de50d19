"""Spot checks that cannot be dodged (issue 55), through the real wire: the reference coordinator with its defaults
seeds every sampled job and checks a share of them; a node that strips its proofs, or that lies about how it
sampled, ends `failed` in its tally, not `unchecked` or `errors`. The verifier is never the producer nor a node on
its address, and a verify job has a deadline of its own. Each producer hears the verdicts on its own jobs."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from types import SimpleNamespace

from coordinator_client.identity import Identity
from coordinator_client.network_terms import NETWORK_MAX_TOKENS, network_terms
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from coordinator_client.spot_checks import DEFAULT_VERIFY_FRACTION, NO_PROOF, VERIFY_DEADLINE_S, SpotChecks, siblings
from provider.outputs import Done
from provider.logs import CLIP_CHARS
from tests.helpers import run, until
from tools.harness.nodes import harness


def lying(node, alter) -> None:
    """The node signs and sends what `alter` makes of each Done (a dishonest operator's patch on the real node)."""
    real = node.run

    def run_job(job):
        stream = real(job)
        put = stream._queue.put_nowait
        stream._queue.put_nowait = lambda ev: put(alter(ev) if isinstance(ev, Done) else ev)
        return stream

    node.run = run_job


def strip(ev: Done) -> Done:
    return dataclasses.replace(ev, proof=None)


def claim_speculative(ev: Done) -> Done:
    return dataclasses.replace(ev, proof=dataclasses.replace(ev.proof, sampler="speculative", seed=None))


def _job(job_id: str, i: int) -> pb.JobRequest:
    # Sampled, no seed: the coordinator gives it one.
    return pb.JobRequest(job_id=job_id, model="m", max_tokens=24, sampling=pb.SamplingParams(temperature=0.8),
                         chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=f"Tell me {i} things")]))


def test_a_node_that_strips_proofs_or_lies_about_its_sampler_ends_failed(fixtures_dir, tmp_path):
    names = ("honest", "stripper", "liar", "verifier")
    ids = {name: Identity.load_or_create(tmp_path / name).node_id for name in names}
    model = fixtures_dir / "gemma4-tiny"

    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200, verify_seed=0)  # its defaults
        assert coord.spot_checks.fraction == DEFAULT_VERIFY_FRACTION > 0
        await coord.start()
        async with contextlib.AsyncExitStack() as stack:
            nodes, sessions = {}, {}
            for name in names:
                _, nodes[name], sessions[name] = await stack.enter_async_context(
                    harness({"m": model}, tmp_path / name, coordinator=coord, commitments="on"))
            await until(lambda: len(coord.sessions) == len(names), "every session")
            assert all(s.registration.verification.commits for s in coord.sessions.values())
            lying(nodes["stripper"], strip)
            lying(nodes["liar"], claim_speculative)
            coord.spot_checks.verifiers = {ids["verifier"]}
            coord.spot_checks.fraction = 1.0  # every job, so the test does not wait on chance
            sent = []
            for name in ("honest", "stripper", "liar"):
                for i in range(2):
                    job_id = f"{name}-{i}"
                    coord.dispatch(coord.sessions[ids[name]], _job(job_id, i))
                    sent.append(job_id)
            for job_id in sent:
                assert (await coord.outcome(job_id)).WhichOneof("frame") == "job_done", job_id
            await until(lambda: not coord.spot_checks.pending and sum(
                t.checked + t.errors + t.unchecked for t in coord.spot_checks.tally.values()) == len(sent),
                "every verdict", 300)
            # and each producer was told of each verdict on its jobs (SpotCheckResult), as the tally has it
            await until(lambda: all(sessions[n].verdicts.passed + sessions[n].verdicts.failed == 2
                                    for n in ("honest", "stripper", "liar")), "the producers told")
            return coord, {n: sessions[n].verdicts.as_dict() for n in names}

    coord, heard = run(main())
    for job_id, request in coord.requests.items():  # every job went out seeded
        assert request.sampling.HasField("seed"), request
    tally = {name: coord.spot_checks.tally[ids[name]] for name in ("honest", "stripper", "liar")}
    assert (tally["honest"].checked, tally["honest"].passed) == (2, 2), tally
    assert (tally["stripper"].failed, tally["stripper"].unchecked) == (2, 0), tally
    assert {f["reason"] for f in tally["stripper"].failures} == {NO_PROOF}
    assert (tally["liar"].failed, tally["liar"].errors) == (2, 0), tally
    assert all(f["first_failure"] == 0 and "seed" in f["reason"] for f in tally["liar"].failures), tally["liar"]
    assert (heard["honest"]["passed"], heard["honest"]["failed"], heard["verifier"]["passed"]) == (2, 0, 0), heard
    for name in ("stripper", "liar"):  # what the page and `provider status --json` show them
        told = {(f["job_id"], f["reason"], f["first_failure"]) for f in heard[name]["recent_failures"]}
        assert told == {(f["job_id"], f["reason"][:CLIP_CHARS], f["first_failure"]) for f in tally[name].failures}, \
            heard[name]
    honest_proofs = [o for j, o in coord.outcomes.items() if j.startswith("honest")]
    assert all(o[0].job_done.completion.proof.sampler == pb.PROOF_SAMPLER_REPLAYABLE for o in honest_proofs)


def test_the_verifier_is_never_the_producer_or_its_sibling_and_its_job_has_its_own_deadline():
    def session(node_id, peer):
        return SimpleNamespace(node_id=node_id, peer=peer, registration=pb.Registration())

    producer = session("a", "ipv4:203.0.113.5:40000")
    sibling = session("b", "ipv4:203.0.113.5:40111")  # another key on the producer's address
    v6_sibling = session("c", "ipv6:[2001:db8::1]:1"), session("d", "ipv6:[2001:db8::1]:2")
    stranger = session("e", "ipv4:198.51.100.7:40000")
    local = session("f", "ipv4:127.0.0.1:5"), session("g", "ipv4:127.0.0.1:6")
    assert siblings(producer, sibling) and siblings(*v6_sibling) and not siblings(producer, stranger)
    assert not siblings(*local)  # loopback tells nothing: every local test node has it
    checks = SpotChecks(1.0, seed=1)
    sessions = {s.node_id: s for s in (producer, sibling, stranger)}
    assert {checks.checker(producer, sessions).node_id for _ in range(50)} == {"e"}
    assert checks.checker(producer, {"a": producer, "b": sibling}) is None

    original = pb.JobRequest(job_id="j", deadline_ms=int(time.time() * 1000) + 50, max_tokens=8)
    request = checks.verify_request(original, [5, 6], pb.Proof(commitment=b"C"))
    assert request.deadline_ms / 1000 - time.time() > VERIFY_DEADLINE_S - 60  # not the producer's to spend


def test_the_network_seeds_every_sampled_job_and_names_its_max_tokens():
    sampled, default_temperature, greedy, seeded = (
        pb.JobRequest(sampling=pb.SamplingParams(temperature=0.7)), pb.JobRequest(),
        pb.JobRequest(sampling=pb.SamplingParams(temperature=0.0), max_tokens=5),
        pb.JobRequest(sampling=pb.SamplingParams(temperature=0.7, seed=3), max_tokens=5))
    for r in (sampled, default_temperature, greedy, seeded):
        network_terms(r)
    assert sampled.sampling.HasField("seed") and default_temperature.sampling.HasField("seed")  # T defaults to 1
    assert not greedy.sampling.HasField("seed") and seeded.sampling.seed == 3  # a request's own seed is kept
    assert sampled.max_tokens == NETWORK_MAX_TOKENS and greedy.max_tokens == 5
    other = pb.JobRequest(sampling=pb.SamplingParams(temperature=0.7))
    network_terms(other)
    assert other.sampling.seed != sampled.sampling.seed  # each job its own


def test_only_the_chosen_checker_answers_and_an_invalid_claim_fails():
    """A verify job's id is no secret: the producer (or anyone) sending an outcome under it is ignored, and a claim
    the checker refuses as invalid (a proof no honest node sends) counts as failed, not as an error."""
    checks = SpotChecks(1.0)
    checks.sent("verify-j", "producer", "j", "checker")
    forged = pb.ProviderFrame(job_error=pb.JobError(job_id="verify-j", cause=pb.ERROR_CAUSE_INTERNAL))
    checks.answered(forged, SimpleNamespace(node_id="producer"))
    assert "verify-j" in checks.pending and "producer" not in checks.tally
    refused = pb.ProviderFrame(job_error=pb.JobError(job_id="verify-j", cause=pb.ERROR_CAUSE_INVALID_REQUEST,
                                                     message="verify.proof.seed: a replayable proof needs the seed"))
    checks.answered(refused, SimpleNamespace(node_id="checker"))
    t = checks.tally["producer"]
    assert (t.failed, t.errors) == (1, 0) and "invalid" in t.failures[0]["reason"], t


def test_a_coordinators_verdicts_are_counted_bounded_and_never_stop_the_node(fixtures_dir, tmp_path):
    """SpotCheckResult is informational and a coordinator may send any: an id no job could have is refused with a
    ProtocolError, a verdict on a job the node has no outcome of is counted apart (never as its own), a reason is
    kept cut short and printable (no escape sequence or forged line reaches `provider status`), and the session
    keeps serving."""
    async def main():
        async with harness({"m": fixtures_dir / "llama-tiny"}, tmp_path) as (coord, node, session):
            await until(lambda: coord.sessions, "a session")
            (s,) = coord.sessions.values()
            coord.dispatch(s, pb.JobRequest(job_id="ran", model="m", prompt="The cache", max_tokens=4))
            assert (await coord.outcome("ran")).WhichOneof("frame") == "job_done"
            for result in (pb.SpotCheckResult(job_id="x" * 70_000), pb.SpotCheckResult(),
                           pb.SpotCheckResult(job_id="never-ran", passed=True),
                           pb.SpotCheckResult(job_id="ran", first_failure=3,
                                              reason="\x1b[2J\n  coordinator: SPOOFED" + "r" * (1 << 20))):
                coord.send(s, pb.CoordinatorFrame(spot_check_result=result))
            coord.dispatch(s, pb.JobRequest(job_id="after", model="m", prompt="The cache", max_tokens=4))
            assert (await coord.outcome("after")).WhichOneof("frame") == "job_done"
            await until(lambda: session.verdicts.failed == 1 and len(coord.protocol_errors) == 2, "every verdict")
            return session.verdicts.as_dict(), list(coord.protocol_errors)

    heard, refused = run(main())
    assert (heard["passed"], heard["failed"], heard["unknown_jobs"]) == (0, 1, 1), heard
    assert all(e.frame_kind == "spot_check_result" and "job_id" in e.reason for e in refused), refused
    (failure,) = heard["recent_failures"]
    assert failure["job_id"] == "ran" and failure["first_failure"] == 3, failure
    assert len(failure["reason"]) <= CLIP_CHARS and failure["reason"].isprintable(), failure["reason"][:40]
