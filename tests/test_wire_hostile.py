"""Issue 36, the coordinator's half: the wire against a hostile coordinator. Drain floods, hashes that let a
relaying coordinator confirm a sealed job's content, a result signature that was not canonical, work done before
a frame's bounds were checked, logs a coordinator can fill, a Reject that parks the node for ever, and sealed
values echoed in error messages. Real gRPC on loopback against the reference coordinator; the held pin check is
an injected fault, named as such."""

import asyncio
import functools
import gc
import threading
import time
import tracemalloc
from pathlib import Path

import psutil
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from structlog.testing import capture_logs

from coordinator_client import convert
from coordinator_client.backoff import MAX_RETRY_AFTER_S, reconnect_delay
from coordinator_client.identity import Identity
from coordinator_client.outcomes import InvalidResult, request_digest, result_bytes, token_digest, verify_result
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from coordinator_client.sealing import seal_job
from provider.jobs import MAX_PROMPT_IDS
from provider.logs import get as logs_get
from provider.logs import THROTTLE_BURST, THROTTLE_PER_S, THROTTLE_SUMMARY_S, Throttle
from provider.settings import Settings
from provider.types import JobError
from tests.helpers import run, until
from tools.harness.isolated import run_isolated
from tools.harness.nodes import harness, job

PIN = "0" * 64
MARKER = "SEALEDMARKER7"


def _models(fixtures_dir):
    return {"g": fixtures_dir / "gemma4-tiny"}


async def _round_trip(coord, s, ping_id: int) -> None:
    """A Ping after earlier frames: its Pong means the node has read every frame sent before it (in order)."""
    coord.send(s, pb.CoordinatorFrame(ping=pb.Ping(id=ping_id)))
    await until(lambda: any(kind == "pong" and f.pong.id == ping_id for _, kind, f in coord.frames[-50:]),
                 f"no pong {ping_id}")


# --- finding 5: Drain frames ------------------------------------------------------------------------------------


def _drain_flood(fixtures: str, state_dir: str) -> dict:
    """100,000 Drain frames at a node serving a held job: its RSS and task count before, at the peak, after (run
    in a process of its own: RSS is process-wide, and in a pytest-xdist worker other tests move it)."""
    frames, batch = 100_000, 1000

    async def main():
        async with harness(_models(Path(fixtures)), Path(state_dir)) as (coord, node, session):
            loop, held, release = asyncio.get_running_loop(), asyncio.Event(), threading.Event()

            def held_pin(model, expected):  # fault: a first hash of a large model takes minutes; the job stays running
                loop.call_soon_threadsafe(held.set)
                release.wait(300)
                return model

            node.check_pin = held_pin
            s = await coord.wait_for_node()
            coord.dispatch(s, job("held", "g", max_tokens=2, model_sha256=PIN))
            await asyncio.wait_for(held.wait(), 60)
            await _round_trip(coord, s, 0)
            proc = psutil.Process()
            gc.collect()
            rss_before, tasks_before = proc.memory_info().rss, len(asyncio.all_tasks())
            peak = rss_before
            drain = pb.CoordinatorFrame(drain=pb.Drain()).SerializeToString()  # one bytes object, sent many times
            try:
                for i in range(frames // batch):
                    for _ in range(batch):
                        coord.send(s, drain)
                    await _round_trip(coord, s, i + 1)  # every Drain so far has been read
                    peak = max(peak, proc.memory_info().rss)
                tasks_after = len(asyncio.all_tasks())
            finally:
                release.set()
            await until(lambda: coord.drained, "no Drained")
            await _round_trip(coord, s, 10**6)
            return {"frames": frames, "rss_before": rss_before, "peak": peak, "tasks_before": tasks_before,
                    "tasks_after": tasks_after, "drained": [d.jobs_finished for d in coord.drained],
                    "sessions": session.stats.sessions}

    return run(main())


def test_a_drain_flood_keeps_one_pending_report_and_memory_within_the_outbox_bound(fixtures_dir, tmp_path):
    """100,000 Drain frames while a job runs: the node holds one pending drain report, not one task each."""
    m = run_isolated(_drain_flood, str(fixtures_dir), str(tmp_path))
    growth = m["peak"] - m["rss_before"]
    print(f"{m['frames']} Drain frames: RSS {m['rss_before'] / 2**20:.0f} -> peak {m['peak'] / 2**20:.0f} MiB "
          f"(+{growth / 2**20:.1f} MiB), tasks {m['tasks_before']} -> {m['tasks_after']}")
    assert m["tasks_after"] <= m["tasks_before"] + 1, m  # one pending report at most
    assert growth < Settings().coordinator_outbox_bytes, growth / 2**20
    assert m["drained"] == [1]  # the held job, reported once
    assert m["sessions"] == 1


# --- finding 6: sealed jobs' hashes -----------------------------------------------------------------------------


def test_a_sealed_job_s_hashes_are_keyed_not_the_plaintext_s_sha256(fixtures_dir, tmp_path):
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            body = job("plain", "g", max_tokens=8, prompt="Yes")
            coord.dispatch(s, body)
            plain = (await coord.outcome("plain")).job_done
            sealed_ids = []
            for jid in ("sealed-a", "sealed-b"):  # the same prompt from two senders
                inner = job(jid, "g", max_tokens=8, prompt="Yes")
                coord.dispatch_sealed(s, inner)
                sealed_ids.append(jid)
            a, b = [(await coord.outcome(jid)).job_done for jid in sealed_ids]
            ids = coord.token_ids("plain")
            assert coord.token_ids("sealed-a") == ids == coord.token_ids("sealed-b")  # opened: the same greedy output
            # A relaying coordinator can neither confirm a guess nor link the two senders' identical prompts.
            assert plain.completion.token_ids_sha256 == token_digest(ids)
            for done in (a, b):
                inner = job(done.job_id, "g", max_tokens=8, prompt="Yes")
                assert done.completion.token_ids_sha256 != token_digest(ids)
                assert done.request_sha256 != request_digest(inner)
            assert a.completion.token_ids_sha256 != b.completion.token_ids_sha256
            assert a.request_sha256 != b.request_sha256
            # The sender, which holds the job's keys, checks both; the relaying coordinator checks the request it
            # sent (the sealed one) and the signature.
            assert not coord.bad_results, coord.bad_results
            for done in (a, b):
                keys = coord._run_keys[done.job_id]
                assert done.completion.token_ids_sha256 == token_digest(ids, keys)
                verify_result(done, s.registration.public_key, coord.requests[done.job_id])
                assert coord.requests[done.job_id].HasField("sealed")

    run(main())


# --- finding 7: a canonical model hash in the signature ---------------------------------------------------------


GOOD_HASH = "0123456789abcdef" * 4
BAD_HASHES = ["", "ab", GOOD_HASH[:63], GOOD_HASH + "0", GOOD_HASH.upper(), "g" * 64, " " * 64, "0x" + GOOD_HASH[2:]]


def _signed(identity, model_sha256: str, request: pb.JobRequest) -> pb.JobDone:
    done = pb.JobDone(job_id="j", finish_reason="stop", signature_layout=3, request_sha256=request_digest(request),
                      model_sha256=GOOD_HASH)
    done.completion.token_ids_sha256 = done.completion.proof_sha256 = bytes(32)
    done.signature = identity.sign(result_bytes(done))
    done.model_sha256 = model_sha256  # what a forger or a buggy node puts there, after signing
    return done


@pytest.mark.parametrize("model_sha256", BAD_HASHES)
def test_a_result_whose_model_hash_is_not_64_lowercase_hex_is_refused_typed(tmp_path, model_sha256):
    """"", short hashes and "0" * 64 signed the same bytes; upper and lower case too; a 64-character non-hex hash
    raised ValueError out of verify_result. Each is now refused with InvalidResult, by the signer and the
    verifier."""
    identity = Identity.load_or_create(tmp_path)
    request = pb.JobRequest(job_id="j", model="m", prompt="The cache")
    done = _signed(identity, model_sha256, request)
    with pytest.raises(InvalidResult):
        result_bytes(done)
    with pytest.raises(InvalidResult):
        verify_result(done, identity.public_key, request)


def test_no_two_model_hashes_sign_alike_and_the_reference_coordinator_refuses_malformed_results(fixtures_dir,
                                                                                                tmp_path):
    zeros = pb.JobDone(job_id="j", finish_reason="stop", request_sha256=bytes(32), model_sha256="0" * 64)
    zeros.completion.token_ids_sha256 = bytes(32)
    assert result_bytes(zeros)  # a real (if unlikely) hash: 32 zero bytes, and nothing else signs them

    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("one", "g", max_tokens=3))
            done = (await coord.outcome("one")).job_done
            for bad in BAD_HASHES:
                forged = pb.JobDone()
                forged.CopyFrom(done)
                forged.model_sha256 = bad
                assert "model_sha256" in coord.check_result(s, forged), bad  # typed, not a ValueError
            coord.dispatch(s, job("two", "g", max_tokens=3))  # the node and the coordinator go on
            assert (await coord.outcome("two")).job_done.model_sha256 == done.model_sha256
            assert session.stats.sessions == 1

    run(main())


# --- finding 8: bounds before work -------------------------------------------------------------------------------


def _chat(**message) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(**message)])


HUGE_FIELDS = ("prompt_ids", "stop", "stop_token_ids", "chat.messages", "parts", "tool_calls")  # as below


def _huge_requests():
    many = 200_000
    yield "prompt_ids", pb.JobRequest(job_id="j", prompt_ids=pb.PromptTokens(ids=[1000] * (MAX_PROMPT_IDS + 1)))
    yield "stop", pb.JobRequest(job_id="j", prompt="x", stop=[""] * many)
    yield "stop_token_ids", pb.JobRequest(job_id="j", prompt="x", stop_token_ids=[1000] * many)
    yield "chat.messages", pb.JobRequest(job_id="j", chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="x")] * many))
    yield "parts", pb.JobRequest(job_id="j", chat=_chat(role="user", parts=[pb.ContentPart(text="x")] * many))
    yield "tool_calls", pb.JobRequest(job_id="j", chat=_chat(role="assistant", tool_calls=[
        pb.ToolCall(id="c", name="f", arguments="{}")] * many))


def _refusal_peaks() -> dict:
    """Each huge field's refusal, and the most Python allocated while it was made (tracemalloc's peak, which is
    process-wide: run in a process of its own, where no other test's thread allocates meanwhile)."""
    out = {}
    for field, req in _huge_requests():
        tracemalloc.start()
        try:
            try:
                convert.job_from_request(req, max_tokens_limit=100, default_max_tokens=10)
                cause = None
            except JobError as e:
                cause = e.cause.value
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        out[field] = {"cause": cause, "peak": peak}
    return out


@functools.cache
def _refusals() -> dict:
    return run_isolated(_refusal_peaks)


@pytest.mark.parametrize("field", HUGE_FIELDS)
def test_a_repeated_field_past_its_bound_is_refused_before_its_elements_are_built(field):
    """The count is checked before a single element is turned into a Python object: the refusal allocates almost
    nothing, where building the tuple first held the whole field (1M prompt ids: +122 MiB from a 15 MiB frame)."""
    got = _refusals()[field]
    assert got["cause"] == "invalid_request", got
    assert got["peak"] < 1 << 20, f"{field}: {got['peak'] / 2**20:.1f} MiB allocated before the refusal"


def test_a_huge_job_id_is_refused_before_its_sealed_body_is_opened_and_never_echoed(fixtures_dir, tmp_path):
    """A bad job id is answered with a ProtocolError that says its length, not with a JobError under it: echoed,
    an id near the 64 MiB frame limit made an answer over it, and the session died (a coordinator on grpc's
    default 4 MiB limit lost its stream to a 4 MiB id)."""
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            long_id = "x" * (1 << 20)
            sealed, _ = seal_job(s.registration.sealing_key, long_id, job(long_id, "g"))  # a seal that would open
            coord.send(s, pb.CoordinatorFrame(job_request=pb.JobRequest(job_id=long_id, model="g", sealed=sealed)))
            await until(lambda: coord.protocol_errors, "no ProtocolError")
            err = coord.protocol_errors[-1]
            assert err.frame_kind == "job_request" and f"has {1 << 20}" in err.reason and len(err.reason) < 200
            assert sealed.sender_key not in session.sealing._seen, "the body was opened before the id was checked"
            near_limit = "y" * ((64 << 20) - 20)  # a frame just under 64 MiB; a JobError echoing it, 28 bytes over
            coord.send(s, pb.CoordinatorFrame(job_request=pb.JobRequest(job_id=near_limit, model="g", prompt="x")))
            del near_limit
            await until(lambda: len(coord.protocol_errors) == 2, "no second ProtocolError")
            assert not coord.outcomes.get(long_id) and not session.jobs.outcomes.unacked
            # And a frame of 2M prompt ids, over the wire: refused by count.
            coord.send(s, pb.CoordinatorFrame(job_request=pb.JobRequest(
                job_id="many-ids", model="g", prompt_ids=pb.PromptTokens(ids=[1000] * (2 * MAX_PROMPT_IDS)))))
            err = (await coord.outcome("many-ids")).job_error
            assert err.cause == pb.ERROR_CAUSE_INVALID_REQUEST and str(MAX_PROMPT_IDS) in err.message
            coord.dispatch(s, job("after", "g", max_tokens=2))
            assert (await coord.outcome("after")).job_done.finish_reason == "length"
            assert session.stats.sessions == 1  # the stream never dropped

    run(main())


# --- finding 9: logs a coordinator can fill ------------------------------------------------------------------


def test_repeated_garbage_frames_give_a_bounded_number_of_log_lines(fixtures_dir, tmp_path):
    """Every unusable frame is still answered with a ProtocolError; its log line is throttled per kind, and what
    is dropped is counted in `log_suppressed` lines (the last when the session ends)."""
    per_kind = 5000
    kinds = {"garbled": b"\xff\xff\xff garbled \x00\x01", "empty": pb.CoordinatorFrame().SerializeToString(),
             "welcome": pb.CoordinatorFrame(welcome=pb.Welcome(session_id="again")).SerializeToString()}

    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            started = time.monotonic()
            for i in range(per_kind):
                for frame in kinds.values():
                    coord.send(s, frame)
                if i % 500 == 499:
                    await _round_trip(coord, s, i)
            await _round_trip(coord, s, 10**6)
            assert session.stats.protocol_errors == per_kind * len(kinds)  # each still answered on the wire
            assert session.stats.sessions == 1
            return time.monotonic() - started

    with capture_logs() as logged:
        elapsed = run(main())
    lines = [e for e in logged if e["event"].startswith("coordinator_protocol_error") or e["event"] == "log_suppressed"]
    frames = per_kind * len(kinds)
    print(f"{frames} unusable frames in {elapsed:.1f} s: {len(lines)} log lines")
    assert len(lines) < frames / 10, len(lines)
    # Per kind: the burst, the refill over the run, one summary per period and the last one at the session's end.
    bound = len(kinds) * (THROTTLE_BURST + THROTTLE_PER_S * elapsed + elapsed / THROTTLE_SUMMARY_S + 2)
    assert len(lines) <= bound, (len(lines), bound)
    summaries = [e for e in logged if e["event"] == "log_suppressed"]
    assert summaries and sum(e["suppressed"] for e in summaries) + len(lines) - len(summaries) == frames




def test_the_throttle_passes_a_burst_then_a_rate_and_counts_what_it_drops():
    now = [0.0]
    t = Throttle(burst=3, per_s=1.0, summary_s=10.0, clock=lambda: now[0])
    assert [t.admit("k")[0] for _ in range(5)] == [True, True, True, False, False]
    assert t.admit("other-key") == (True, 0)  # each key has its own bucket
    now[0] = 1.0
    assert t.admit("k") == (True, 0) and t.admit("k") == (False, 0)  # one more after a second
    now[0] = 10.5
    assert [t.admit("k")[0] for _ in range(3)] == [True, True, True]  # refilled to the burst, not past it
    assert t.admit("k") == (False, 4)  # a summary is due: the three dropped before and this one
    with capture_logs() as logged:
        t.admit("k")
        t.flush(logs_get("test"))
    assert [(e["event"], e["key"], e["suppressed"]) for e in logged] == [("log_suppressed", "k", 1)]
# --- finding 10: Reject.retry_after_s -----------------------------------------------------------------------


def test_a_reject_s_retry_after_is_capped(fixtures_dir, tmp_path):
    """The node waits the longer of its backoff and a Reject's retry_after_s, which is capped."""
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200)
        await coord.start()
        coord.next_reject = pb.Reject(reason="come back in 136 years", retry_after_s=2**32 - 1)
        async with harness(_models(fixtures_dir), tmp_path, coordinator=coord) as (_, _n, session):
            await until(lambda: session.stats.reconnect_delays, "no reconnect")
            delay = session.stats.reconnect_delays[0]
        assert delay == MAX_RETRY_AFTER_S, delay  # not 2^32 - 1 s (136 years)
        assert reconnect_delay(0.5, 2**32 - 1) == MAX_RETRY_AFTER_S
        assert reconnect_delay(0.5, 7) == 7 and reconnect_delay(12.0, 7) == 12.0 and reconnect_delay(3.0, 0) == 3.0

    run(main())


# --- finding 11: sealed values echoed in error messages ---------------------------------------------------------


def _leaky(jid: str) -> dict[str, pb.JobRequest]:
    """Requests whose errors name values from the request (useful for a plain job, a leak for a sealed one)."""
    chat = _chat(role="user", content="x")
    return {
        "tool_choice": pb.JobRequest(job_id=f"{jid}-tc", model="g", chat=chat, tools=[pb.Tool(name="f")],
                                     tool_choice=MARKER),
        "tool_name": pb.JobRequest(job_id=f"{jid}-tn", model="g", chat=chat, tools=[pb.Tool(name=MARKER + " x")]),
        "response_format": pb.JobRequest(job_id=f"{jid}-rf", model="g", prompt="x",
                                         response_format=pb.ResponseFormat(type=MARKER)),
        # Refused by the grammar compiler, in the engine's preparation: the error comes back as the job's Error.
        "schema": pb.JobRequest(job_id=f"{jid}-sc", model="g", prompt="x", max_tokens=4,
                                response_format=pb.ResponseFormat(type="json_schema", schema_name="r",
                                                                  schema_json='{"type": "string", "format": "'
                                                                              + MARKER + '"}')),
    }


FIELDS = {"tool_choice": "tool_choice", "tool_name": "tools", "response_format": "response_format",
          "schema": "response_format"}  # what each sealed error still names: the field, not its value


def test_a_sealed_job_s_error_message_carries_nothing_from_its_sealed_body(fixtures_dir, tmp_path):
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            plain, sealed = _leaky("plain"), _leaky("sealed")
            for req in plain.values():
                coord.dispatch(s, req)
            for req in sealed.values():
                coord.dispatch_sealed(s, req)
            for name in sealed:
                p = (await coord.outcome(plain[name].job_id)).job_error
                e = (await coord.outcome(sealed[name].job_id)).job_error
                assert e.cause == p.cause == pb.ERROR_CAUSE_INVALID_REQUEST, (name, p, e)
                assert MARKER not in e.message and f"(field {FIELDS[name]})" in e.message, (name, e.message)
                assert MARKER in p.message, (name, p.message)  # a plain job's message stays specific

    run(main())


@pytest.mark.parametrize("param, kept", [
    ("tool_choice", True), ("chat.messages[2].parts[0]", True), ("messages[0].role", True), ("top_p", True),
    ("job_id", True), ("get_weather", False), (MARKER, False), (f"tools[{MARKER}]", False), ("tools.x y", False),
    ("", False), (None, False)])
def test_a_sealed_error_names_its_param_only_when_that_is_a_field_s_name(param, kept):
    from coordinator_client.sealed_errors import sealed_message
    from provider.types import Cause

    message = sealed_message(Cause.INVALID_REQUEST, f"{param} is wrong, got {MARKER!r}", param)
    assert MARKER not in message and (f"(field {param})" in message) == kept, message
    envelope = "the sealed job did not open: the sealed bytes do not open with this job's key"
    assert sealed_message(Cause.SEALING_FAILED, envelope, None) == envelope  # about the envelope: kept
