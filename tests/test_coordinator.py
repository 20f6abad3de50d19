"""The coordinator session against the reference coordinator: real gRPC on loopback, real MLX generation."""

import asyncio
import dataclasses
import secrets
import time
from pathlib import Path

import grpc
import pytest

from coordinator_client.identity import SIGNING_DOMAIN, Identity
from coordinator_client.outcomes import brief
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from coordinator_client.session import CoordinatorSession
from provider.settings import Settings
from tests import reference
from tools.harness.isolated import run_isolated
from tools.harness.nodes import FAST_RECONNECT, FaultReport, harness, job, kill_restart_scenario
from tests.helpers import held_models, run, until


def test_greedy_job_equals_mlx_lm_and_done_carries_usage_and_telemetry(fixtures_dir, tmp_path):
    path = fixtures_dir / "gemma4-tiny"
    messages = [{"role": "user", "content": "What is a cache?"}]

    async def main():
        async with harness({"g": path}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
            coord.dispatch(s, pb.JobRequest(job_id="j1", model="g", chat=chat, max_tokens=40,
                                            sampling=pb.SamplingParams(temperature=0)))
            done = (await coord.outcome("j1")).job_done
            expected_ids, expected_text = reference.greedy(path, reference.chat_ids(path, messages), 40)
            assert coord.token_ids("j1") == expected_ids
            assert coord.text("j1") == expected_text
            assert [c.seq for c in coord.chunks["j1"]] == list(range(len(coord.chunks["j1"])))
            assert done.usage.completion_tokens == len(expected_ids) and done.usage.prompt_tokens > 0
            assert done.telemetry.HasField("ttft_ms") and done.telemetry.decode_tokens_per_s > 0
            assert done.telemetry.speculation.mode == "off" and done.telemetry.speculation.reason
            assert coord.accepted["j1"].prompt_tokens == done.usage.prompt_tokens

    run(main())


def test_registration_and_heartbeats(fixtures_dir, tmp_path):
    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            reg = s.registration
            assert reg.node_id == Identity.load_or_create(tmp_path).node_id  # stable across restarts
            assert reg.protocol_version == 1 and reg.backend == pb.BACKEND_CPU and len(reg.public_key) == 32
            assert reg.memory.budget_bytes > 0 and reg.memory.total_bytes > reg.memory.budget_bytes
            (model,) = reg.models
            assert model.id == "g" and model.capabilities.family == "gemma4" and model.size_bytes > 0
            coord.dispatch(s, job("warm", "g"))
            await coord.outcome("warm")
            # A heartbeat read after the outcome was built after it: frames leave the node's outbox in order.
            seen = len(s.heartbeats)
            await until(lambda: len(s.heartbeats) > seen, "no heartbeat after the outcome")
            hb = s.heartbeats[-1]
            assert hb.resident_models == ["g"] and hb.counters.jobs_completed == 1
            assert hb.status == pb.NODE_STATUS_IDLE and hb.memory.active_bytes > 0
            # What the node's page says of the session (daemon.session_detail reads these).
            assert 0 <= time.time() - session.connected_since < 120 and session.jobs.stats.jobs_received == 1
        assert session.connected_since is None  # the session ended

    run(main())


def test_cancel_stops_within_one_step_and_frees_the_slot(fixtures_dir, tmp_path):
    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path, max_concurrent_jobs=1) as (coord, node, _):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("long", "g", max_tokens=1000))
            await until(lambda: len(coord.chunks["long"]) >= 3, "the long job never streamed")
            sent = sum(len(c.token_ids) for c in coord.chunks["long"])
            coord.send(s, pb.CoordinatorFrame(cancel=pb.Cancel(job_id="long")))
            coord.send(s, pb.CoordinatorFrame(cancel=pb.Cancel(job_id="long")))  # harmless
            done = (await coord.outcome("long")).job_done
            assert done.finish_reason == "cancelled"
            # Tokens already in flight when the cancel arrived, plus at most one step.
            assert done.usage.completion_tokens <= sent + 3
            coord.send(s, pb.CoordinatorFrame(cancel=pb.Cancel(job_id="long")))  # after the end: harmless
            coord.dispatch(s, job("next", "g", max_tokens=4))  # the single slot is free again
            assert (await coord.outcome("next")).job_done.finish_reason in ("length", "stop")
            assert len(coord.outcomes["long"]) == 1

    run(main())


def test_bad_frames_get_typed_errors_and_the_session_stays_up(fixtures_dir, tmp_path):
    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            cases = {
                "no-input": (pb.JobRequest(job_id="no-input", model="g", max_tokens=4), pb.ERROR_CAUSE_INVALID_REQUEST),
                "unknown": (job("unknown", "gpt-17"), pb.ERROR_CAUSE_UNKNOWN_MODEL),
                "oversized": (job("oversized", "g", prompt="word " * 5000), pb.ERROR_CAUSE_CONTEXT_LENGTH_EXCEEDED),
                # A negative max_tokens from a careless coordinator arrives as a huge uint32.
                "negative": (job("negative", "g", max_tokens=(-1) & 0xFFFFFFFF), pb.ERROR_CAUSE_INVALID_REQUEST),
                "bad-temp": (job("bad-temp", "g", temperature=7.0), pb.ERROR_CAUSE_INVALID_REQUEST),
                "bad-role": (pb.JobRequest(job_id="bad-role", model="g", chat=pb.ChatMessages(
                    messages=[pb.ChatMessage(role="wizard", content="x")])), pb.ERROR_CAUSE_INVALID_REQUEST),
                "late": (job("late", "g", deadline_ms=int(time.time() * 1000) - 1000), pb.ERROR_CAUSE_DEADLINE_EXCEEDED),
            }
            coord.send(s, b"\xff\xff\xff garbled \x00\x01")  # not a frame at all
            for req, _ in cases.values():
                coord.dispatch(s, req)
            for jid, (_, cause) in cases.items():
                err = (await coord.outcome(jid)).job_error
                assert err.cause == cause, (jid, err)
                assert err.message
            assert session.stats.garbled_frames == 1
            coord.dispatch(s, job("good", "g", max_tokens=4))
            assert (await coord.outcome("good")).WhichOneof("frame") == "job_done"
            assert session.stats.sessions == 1  # never reconnected

    run(main())


def test_twenty_jobs_at_once_are_all_served(fixtures_dir, tmp_path):
    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path) as (coord, node, _):
            s = await coord.wait_for_node()
            for i in range(20):
                coord.dispatch(s, job(f"j{i}", "g", prompt=f"prompt {i}", max_tokens=8))
            outcomes = [await coord.outcome(f"j{i}") for i in range(20)]
            assert all(o.WhichOneof("frame") == "job_done" for o in outcomes)
            assert all(len(coord.outcomes[f"j{i}"]) == 1 for i in range(20))

    run(main())


def test_drain_finishes_in_flight_refuses_new_and_says_so(fixtures_dir, tmp_path):
    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path) as (coord, node, _):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("inflight", "g", max_tokens=60))
            await until(lambda: coord.chunks["inflight"], "the job never streamed")
            coord.send(s, pb.CoordinatorFrame(drain=pb.Drain()))
            coord.dispatch(s, job("after", "g"))
            assert (await coord.outcome("after")).job_error.cause == pb.ERROR_CAUSE_DRAINING
            done = (await coord.outcome("inflight")).job_done
            assert done.finish_reason in ("length", "stop") and done.usage.completion_tokens > 1
            await until(lambda: coord.drained, "no Drained")
            assert coord.drained[0].jobs_finished == 1
            seen = len(s.heartbeats)  # one read after Drained was built after the drain began
            await until(lambda: len(s.heartbeats) > seen, "no heartbeat after Drained")
            assert s.heartbeats[-1].status == pb.NODE_STATUS_DRAINING

    run(main())


def test_quick_rejoin_replaces_the_old_session(fixtures_dir, tmp_path):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200)
        await coord.start()
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path, coordinator=coord) as (_, node, first):
            old = await coord.wait_for_node()
            # The same node (same key) connects again, as after a crash and a fast restart.
            second = CoordinatorSession(node, Settings(coordinator=coord.url, **FAST_RECONNECT),
                                        Identity.load_or_create(tmp_path))
            stop = asyncio.Event()
            task = asyncio.create_task(second.run(stop))
            new = await coord.wait_for_node(after=old.session_id)
            assert new.epoch > old.epoch and new.node_id == old.node_id
            assert list(coord.sessions) == [old.node_id] and old.ended.is_set()  # no ghost
            stop.set()
            await task

    run(main())


async def _raw_hello(coord: ReferenceCoordinator, make_hello) -> pb.CoordinatorFrame:
    """Speak to the coordinator directly: read the challenge, send what `make_hello(nonce)` builds."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}") as ch:
        call = ch.stream_stream("/provider.v1.Coordinator/Connect",
                                request_serializer=pb.ProviderFrame.SerializeToString,
                                response_deserializer=pb.CoordinatorFrame.FromString)()
        challenge = await call.read()
        await call.write(pb.ProviderFrame(hello=make_hello(challenge.challenge.nonce)))
        return await call.read()


def test_wrong_signature_stale_nonce_and_old_epoch_are_rejected(tmp_path):
    identity = Identity.load_or_create(tmp_path)

    def reg(nonce, epoch=1, **kw):
        return pb.Registration(node_id=identity.node_id, public_key=identity.public_key, nonce=nonce,
                               timestamp_ms=int(time.time() * 1000), session_epoch=epoch, **kw)

    async def main():
        coord = ReferenceCoordinator()
        await coord.start()
        good = await _raw_hello(coord, lambda n: identity.hello(reg(n)))
        assert good.WhichOneof("frame") == "welcome"

        def forged(n):  # signed with another key
            body = reg(n, epoch=2).SerializeToString()
            return pb.Hello(registration=body, signature=Identity.load_or_create(tmp_path / "other").sign(
                SIGNING_DOMAIN + body))

        def tampered(n):  # valid signature over different bytes
            h = identity.hello(reg(n, epoch=3))
            return pb.Hello(registration=reg(n, epoch=3, max_concurrent_jobs=99).SerializeToString(),
                            signature=h.signature)

        captured = {}

        def replay(n):  # a hello signed for an earlier challenge
            return identity.hello(reg(captured.setdefault("nonce", secrets.token_bytes(32)), epoch=4))

        cases = [(forged, "bad signature"), (tampered, "bad signature"), (replay, "stale or foreign nonce"),
                 (lambda n: identity.hello(reg(n, epoch=1)), "session epoch is not newer"),
                 (lambda n: pb.Hello(registration=b"\x01garbage", signature=b"x"), "bad registration")]
        for make, reason in cases:
            reply = await _raw_hello(coord, make)
            assert reply.WhichOneof("frame") == "reject" and reason in reply.reject.reason, reply
        await coord.kill()

    run(main())


def _kill_restart(model: str, state_dir: str) -> dict:
    """The scenario in a process of its own: the node's RSS per cycle is this process's, and in a pytest-xdist
    worker other tests' threads, buffers and garbage would move it."""
    return dataclasses.asdict(run(kill_restart_scenario(Path(model), Path(state_dir), cycles=10)))


def test_kill_and_restart_the_coordinator_ten_times(fixtures_dir, tmp_path):
    report = FaultReport(**run_isolated(_kill_restart, str(fixtures_dir / "gemma4-tiny"), str(tmp_path)))
    print("\n" + "\n".join(report.lines()))
    assert report.sessions == 11 and report.reconnects == 10
    assert report.jobs == 30 and report.jobs_with_one_outcome == 30
    assert report.jobs_without_outcome == 0 and report.jobs_with_conflicting_outcomes == 0
    assert report.coordinator_lost >= 10  # the long jobs cut mid-stream
    assert report.completed_streams >= 1 and report.completed_streams_with_gaps_or_duplicates == 0
    assert report.max_reconnect_delay_s <= FAST_RECONNECT["reconnect_max_delay_s"]
    assert report.rss_growth_mb < 64, report.rss_mb


def test_unacked_outcomes_are_resent_after_a_kill(fixtures_dir, tmp_path):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200, ack_outcomes=False)
        await coord.start()
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path, coordinator=coord) as (_, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("once", "g", max_tokens=4))
            first = await coord.outcome("once")
            coord.ack_outcomes = True
            await coord.restart()
            await coord.wait_for_node(after=s.session_id)
            await until(lambda: len(coord.outcomes["once"]) >= 2, "the unacknowledged outcome was not resent")
            again = coord.outcomes["once"][1]
            assert brief(again) == first  # the same outcome again, never a different one
            c = again.job_done.completion  # now with the whole completion, since the chunks went with the session
            assert c.chunks == 4 and list(c.token_ids) == coord.token_ids("once") and c.text == coord.text("once")
            await until(lambda: not session.jobs.outcomes.unacked, "the resent outcome was never acknowledged")

    run(main())


def test_tokens_coalesce_only_while_the_writer_is_behind(fixtures_dir, tmp_path):
    from provider.jobs import Job
    from provider.outputs import Tokens
    from tests.helpers import collect, greedy, make_node

    async def main():
        node = make_node({"g": fixtures_dir / "gemma4-tiny"})
        expected, *_ = await collect(node, Job("ref", "g", greedy(40), prompt="The cache"))
        session = CoordinatorSession(node, Settings(coordinator="grpc://127.0.0.1:1"),
                                     Identity.load_or_create(tmp_path), coalesce_ms=200)
        for backed_up in (True, False):
            outbox: asyncio.Queue = asyncio.Queue()
            if backed_up:
                outbox.put_nowait(pb.ProviderFrame())  # a frame the writer has not sent yet
            ids, sizes = [], []
            async with node.run(Job(f"j{backed_up}", "g", greedy(40), prompt="The cache")) as stream:
                async for ev in stream:
                    if isinstance(ev, Tokens) and ev.token_ids:
                        batch, end = await stream.coalesce(ev, behind=lambda: not outbox.empty(),
                                                           window_s=session.jobs.coalesce_s)
                        sizes.append(len(batch))
                        ids += [t for b in batch for t in b.token_ids]
                        if end is not None:
                            break
            assert ids == expected  # merged in order, nothing lost or repeated
            if backed_up:
                assert max(sizes) > 1 and len(sizes) < len(expected)
            else:
                assert max(sizes) <= 2  # keeping up: what is already waiting, without waiting for more
        await node.stop()

    run(main())


@pytest.mark.parametrize("nonce_bytes", [0, 4, 15])
def test_the_node_does_not_sign_a_short_nonce(fixtures_dir, tmp_path, nonce_bytes):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200, nonce_bytes=nonce_bytes)
        await coord.start()
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path, coordinator=coord) as (_, node, session):
            # A few reconnect attempts (or, if the node did sign, a session that ends them).
            await until(lambda: session.stats.connects >= 3 or session.stats.sessions, "no reconnect attempts")
            assert session.stats.sessions == 0
            assert coord.hellos == 0 and not coord.sessions  # nothing was signed, nothing registered

    run(main())


def test_a_repeated_job_request_never_gets_a_second_run_or_a_different_outcome(fixtures_dir, tmp_path):
    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("twice", "g", max_tokens=40))
            await until(lambda: coord.chunks["twice"], "the job never streamed")
            coord.dispatch(s, job("twice", "g", max_tokens=40))  # while it runs: a no-op
            first = await coord.outcome("twice")
            assert first.job_done.usage.completion_tokens > 0
            seqs = [c.seq for c in coord.chunks["twice"]]
            assert seqs == list(range(len(seqs)))  # one run's chunks, no second stream
            coord.dispatch(s, job("twice", "g", max_tokens=40))  # after it finished (and was acked)
            await until(lambda: len(coord.outcomes["twice"]) >= 2, "the repeat got no outcome")
            # The node answers a finished job's repeat in the call that reads it: a second run would be running
            # now (started in that same call), or would have sent its chunks before its own outcome.
            assert "twice" not in session.jobs._running
            again = coord.outcomes["twice"][1]
            assert brief(again) == first  # the same outcome again, never another; with its whole completion
            assert list(again.job_done.completion.token_ids) == coord.token_ids("twice")
            assert [c.seq for c in coord.chunks["twice"]] == seqs and len(coord.accepted) == 1
            assert node.status().counters.jobs_completed == 1

    run(main())


def test_a_deadline_that_passes_mid_job_ends_it_deadline_exceeded_with_the_usage_so_far(fixtures_dir, tmp_path,
                                                                                     monkeypatch):
    held = held_models(monkeypatch)

    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path) as (coord, node, _):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("slow", "g", max_tokens=5000, prompt="The cache " * 3))
            await until(lambda: coord.chunks["slow"], "the job never streamed")
            # A second job whose deadline passes while it runs: the same rule as one that passed before it began.
            # It is held once it streams, so it is still running when its deadline passes, however fast it decodes;
            # the deadline is far enough to see it start on a loaded machine.
            coord.dispatch(s, job("timed", "g", max_tokens=5000, deadline_ms=int(time.time() * 1000) + 10_000))
            await until(lambda: coord.chunks["timed"], "the job never streamed")
            held.add("g")
            err = (await coord.outcome("timed")).job_error
            assert err.cause == pb.ERROR_CAUSE_DEADLINE_EXCEEDED and "deadline" in err.message
            sent = sum(len(c.token_ids) for c in coord.chunks["timed"])
            assert 0 < err.usage.completion_tokens and err.usage.prompt_tokens > 0
            assert err.usage.completion_tokens >= sent  # every token sent is counted
            coord.send(s, pb.CoordinatorFrame(cancel=pb.Cancel(job_id="slow")))
            assert (await coord.outcome("slow")).job_done.finish_reason == "cancelled"  # a cancel stays a cancel

    run(main())
