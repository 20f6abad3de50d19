"""The wire's small defects (issue 20): every coordinator job gets exactly one outcome, whichever way its serving
ends (the session abandoned during its pin check, a failure while its result is built); a Welcome's heartbeat
interval is clamped; handshake garbage gets a typed refusal. Against the reference coordinator on loopback; the
slow first hash and the failing signer are injected faults, named as such."""

import asyncio
import threading

from structlog.testing import capture_logs

from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from tests.helpers import run, until
from tools.harness.nodes import harness, job

PIN = "0" * 64


def _models(fixtures_dir):
    return {"g": fixtures_dir / "gemma4-tiny"}


async def _one_outcome(coord, job_id: str) -> pb.ProviderFrame:
    await until(lambda: coord.outcomes.get(job_id), f"{job_id}: no outcome")
    return coord.outcomes[job_id][-1]


def test_a_session_abandoned_during_the_pin_check_records_coordinator_lost(fixtures_dir, tmp_path):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200)
        await coord.start()
        async with harness(_models(fixtures_dir), tmp_path, coordinator=coord) as (_, node, session):
            checking, release = asyncio.Event(), threading.Event()
            loop = asyncio.get_running_loop()

            def slow_first_hash(model, expected):  # fault: a first hash of a large model takes minutes
                loop.call_soon_threadsafe(checking.set)
                release.wait(300)  # until the session it came on is gone

            node.check_pin = slow_first_hash
            s = await coord.wait_for_node()
            coord.dispatch(s, job("pinned", "g", max_tokens=4, model_sha256=PIN))
            try:
                await asyncio.wait_for(checking.wait(), 60)
                await coord.kill()  # the session is abandoned while the job waits on its pin
                await coord.start()
                await coord.wait_for_node(after=s.session_id)  # the node has ended the old session: a new one
            finally:
                release.set()
            frame = await _one_outcome(coord, "pinned")
            assert frame.job_error.cause == pb.ERROR_CAUSE_COORDINATOR_LOST
            assert not session.jobs._running and not session.jobs._started and not session.jobs._cancelled
            assert node.status().active_jobs == 0

    run(main())


def test_a_result_that_fails_to_build_still_ends_the_job_once_and_stops_it(fixtures_dir, tmp_path):
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            def broken_signer(data: bytes) -> bytes:  # fault: the signing key's backend fails
                raise RuntimeError("the signer failed")

            s = await coord.wait_for_node()
            session.jobs.identity.sign = broken_signer  # after the handshake, which signs with it too
            coord.dispatch(s, job("unsigned", "g", max_tokens=3))
            frame = await _one_outcome(coord, "unsigned")
            assert frame.job_error.cause == pb.ERROR_CAUSE_INTERNAL and "failed" in frame.job_error.message
            assert len(coord.outcomes["unsigned"]) == 1 and not session.jobs._running
            del session.jobs.identity.sign  # the real signer again: the node goes on serving
            coord.dispatch(s, job("after", "g", max_tokens=3))
            assert (await _one_outcome(coord, "after")).job_done.finish_reason == "length"

    run(main())


def test_a_welcome_s_heartbeat_interval_is_clamped(fixtures_dir, tmp_path):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=1)  # a thousand status builds a second, unclamped
        await coord.start()
        async with harness(_models(fixtures_dir), tmp_path, coordinator=coord) as (_, node, session):
            s = await coord.wait_for_node()
            await until(lambda: len(s.heartbeats) >= 11, "fewer than 11 heartbeats")  # bounds only a hang
            # Stamped by the node as it builds each one: ten intervals of at least 0.1 s (unclamped, 1 ms), however
            # late they are read. The stamps are whole milliseconds of the wall clock, hence the 2 ms.
            stamps = [hb.timestamp_ms for hb in s.heartbeats[:11]]
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            assert min(gaps) >= 100 - 2, gaps

    with capture_logs() as logged:
        run(main())
    (clamped,) = [e for e in logged if e["event"] == "coordinator_heartbeat_clamped"]
    assert clamped["asked_s"] == 0.001 and clamped["used_s"] == 0.1, clamped


def test_garbage_for_a_challenge_is_a_typed_refusal_and_the_node_reconnects(fixtures_dir, tmp_path):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200)
        coord.next_challenge = b"\xff\xff\xff garbage \x00"
        await coord.start()
        async with harness(_models(fixtures_dir), tmp_path, coordinator=coord) as (_, node, session):
            s = await coord.wait_for_node(timeout=30)
            coord.dispatch(s, job("after", "g", max_tokens=2))
            assert (await _one_outcome(coord, "after")).job_done.finish_reason == "length"
            assert session.stats.connects >= 2 and session.stats.sessions == 1

    with capture_logs() as logged:
        run(main())
    refusals = [e for e in logged if e["event"] == "coordinator_rejected"]
    assert refusals and "did not decode" in refusals[0]["reason"], logged
    assert not [e for e in logged if e["event"] == "coordinator_session_failed"]  # no traceback: a typed refusal


def test_no_two_results_sign_the_same_bytes():
    """Finding 4: job ids may hold NUL; the old layout joined fields with NUL, so these two signed alike."""
    from coordinator_client.outcomes import result_bytes

    a = pb.JobDone(job_id="j\0length", finish_reason="stop", request_sha256=bytes(32), model_sha256="a" * 64)
    b = pb.JobDone(job_id="j", finish_reason="length\0stop", request_sha256=bytes(32), model_sha256="a" * 64)
    for done in (a, b):
        done.completion.token_ids_sha256 = bytes(32)
    assert result_bytes(a) != result_bytes(b)


def test_a_result_in_another_layout_with_a_short_digest_or_for_another_request_is_refused(tmp_path):
    from coordinator_client.identity import Identity
    from coordinator_client.outcomes import InvalidResult, request_digest, result_bytes, verify_result

    identity = Identity.load_or_create(tmp_path)
    request = pb.JobRequest(job_id="j", model="m", prompt="The cache")
    done = pb.JobDone(job_id="j", finish_reason="stop", signature_layout=3, request_sha256=request_digest(request),
                      model_sha256="a" * 64)
    done.completion.token_ids_sha256 = done.completion.proof_sha256 = bytes(32)
    done.signature = identity.sign(result_bytes(done))
    verify_result(done, identity.public_key, request)  # the real thing verifies
    olds = []
    for layout in (0, 2):  # NUL-joined; signed no proof
        old = pb.JobDone()
        old.CopyFrom(done)
        old.signature_layout = layout
        olds.append((old, request))
    shorts = []
    for field in ("token_ids_sha256", "proof_sha256"):
        short = pb.JobDone()
        short.CopyFrom(done)
        setattr(short.completion, field, bytes(31))
        short.signature = identity.sign(result_bytes(short))  # signed, but no node signs a 31-byte digest
        shorts.append((short, request))
    other = pb.JobRequest(job_id="j", model="m", prompt="Another prompt")
    for bad, against in (*olds, *shorts, (done, other)):
        try:
            verify_result(bad, identity.public_key, against)
        except InvalidResult:
            continue
        raise AssertionError(f"accepted: {bad.signature_layout}, {len(bad.completion.token_ids_sha256)}")


def test_a_stored_result_sent_for_another_request_under_its_id_is_refused(fixtures_dir, tmp_path):
    """The result commits to the request the node opened: a coordinator that reused a job id for another
    request sees that the outcome it got back answers the first one."""
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("reused", "g", max_tokens=2, prompt="The cache"))
            assert (await _one_outcome(coord, "reused")).job_done.signature_layout == 3
            assert not coord.bad_results
            coord.dispatch(s, job("reused", "g", max_tokens=2, prompt="Another prompt"))
            await until(lambda: "reused" in coord.bad_results, "the stored outcome was accepted for another request")
            assert "another request" in coord.bad_results["reused"]

    run(main())


def test_unacked_outcomes_are_bounded_in_bytes_and_bad_ids_are_not_recorded(fixtures_dir, tmp_path):
    """Finding 3: a coordinator that never acks holds the node to MAX_UNACKED_BYTES of outcomes (oldest dropped
    first); a job id over the limit is answered with a ProtocolError, never stored nor echoed."""
    from coordinator_client.outcomes import MAX_UNACKED_BYTES, Outcomes

    store = Outcomes()
    big = "x" * (1 << 20)  # a 1 MiB completion each
    for i in range(100):
        frame = pb.ProviderFrame(job_error=pb.JobError(job_id=f"j{i}", message="m"))
        frame.job_error.completion.text = big
        store.record(f"j{i}", frame)
    assert store.unacked_bytes <= MAX_UNACKED_BYTES and "j99" in store.unacked and "j0" not in store.unacked
    assert store.dropped == 100 - len(store.unacked)
    store.ack(list(store.unacked))
    assert store.unacked_bytes == 0

    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            long_id = "y" * 10_000
            coord.send(s, pb.CoordinatorFrame(job_request=pb.JobRequest(job_id=long_id, model="g", prompt="x")))
            await until(lambda: coord.protocol_errors, "no ProtocolError")
            assert coord.protocol_errors[-1].frame_kind == "job_request" and "10000" in coord.protocol_errors[-1].reason
            assert long_id not in session.jobs.outcomes.unacked and session.jobs.outcomes.finished(long_id) is None

    run(main())
