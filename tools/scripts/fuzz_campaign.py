"""A long fuzz campaign against a live node daemon, over both front ends; prints what happened.

The node runs as `provider start --local --coordinator grpc://127.0.0.1:PORT` (a real process, llama-tiny,
vocabulary 512) with the reference coordinator in this process. Hostile HTTP requests and hostile coordinator
frames come from tools/harness/hostile.py (the fuzz tests' strategies, unbounded here). A good request is sent after
every 100 cases. Then the coordinator's attacks (issue 36): requests past their bounds (ids up to 4 MiB, sealed
ones too; repeated fields of hundreds of thousands of items), malformed results against the reference
coordinator's verifier, and a flood of Drain frames. Expected: 0 5xx, 0 INTERNAL, 0 crashes, 0 tracebacks in the
node's log, 0 hangs, every good request served, every oversized request refused, every malformed result refused
with a typed error, the node's log lines far fewer than its unusable frames. Last, a node group's own wire
(tools/harness/hostile_group.py): hostile lines at the rendezvous and the wake-up port while honest ranks meet
there, and damaged or hostile sealed plans at a follower's decoder; the honest ranks must still meet, every
hostile case end in a typed refusal. Then media (issue 37) against a vision node: the media bombs and hostile
media variants, each a typed 4xx or served, RSS within the media bound (+ the tower's scratch) + 64 MiB.
Between the HTTP cases and the frames, the hostile bodies of the agents' APIs (issue 38,
tools/harness/hostile_agents.py): /v1/messages, count_tokens and /v1/responses, each 4xx in its own API's shape.
Last, issue 56's floods (tools/harness/floods.py) against the bundled model on a coordinator session: count_tokens
and /tokenize of 2.6 MB, chats of 99,999 empty messages, 150,000 tiny tools, previous_response_id chains of 2 MB
requests, values nested 940-999 deep; 0 5xx, /health and a coordinator Ping answered within 100 ms at p99 during
each, RSS bounded Then issue 56's probes on the same node (tools/harness/privacy_probes.py): a sealed prompt probed
by unsealed and sealed jobs in its scope (told 0 cached tokens; a control told it hit), every route and method
from a foreign origin or a rebinding Host (none served), and the disk tier's entries rewritten without its key
beside a symlink, a FIFO and a sparse 1 GiB file planted while the node was down (none used after a restart).

    python tools/scripts/fuzz_campaign.py [--http 2000] [--frames 1000] [--results 500] [--drains 20000]
                                          [--group 1000] [--media 200] [--seed N]
    python tools/scripts/fuzz_campaign.py --media-only [--media 200] [--seed N]
    python tools/scripts/fuzz_campaign.py --floods-only
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from hypothesis import HealthCheck, given, settings, seed as hseed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coordinator_client.convert import MAX_JOB_ID  # noqa: E402
from coordinator_client.identity import InvalidSignature  # noqa: E402
from coordinator_client.outcomes import InvalidResult, verify_result  # noqa: E402
from coordinator_client.pb import provider_pb2 as pb  # noqa: E402
from coordinator_client.reference_coordinator import ReferenceCoordinator  # noqa: E402
from coordinator_client.sealing import seal_job  # noqa: E402
from provider.logs import THROTTLE_BURST, THROTTLE_PER_S, THROTTLE_SUMMARY_S  # noqa: E402
from tools.fixtures import factory  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402
from tools.harness.floods import flood_phase, print_floods  # noqa: E402
from tools.harness.hostile_agents import agent_failures  # noqa: E402
from tools.harness.hostile_group import group_campaign  # noqa: E402
from tools.harness.hostile import (garbage_frames, http_cases, job_requests, malformed_results,  # noqa: E402
                                   residency_frames,
                                   media_bombs, media_cases, oversized_requests)

HANG_S = 30.0
GOOD = {"prompt": "The cache", "max_tokens": 3, "temperature": 0.7}


class Tally:
    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.good_checks = self.good_ok = 0
        self.examples: dict[str, str] = {}  # first case of each bad kind, for the report

    def bad(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        self.examples.setdefault(kind, detail[:300])


def _campaign_settings(n: int, seed: int):
    return lambda f: hseed(seed)(settings(max_examples=n, deadline=None, database=None,
                                          suppress_health_check=list(HealthCheck))(f))


def http_phase(srv: LocalServer, n: int, seed: int, t: Tally) -> None:
    cases = itertools.count(1)

    @_campaign_settings(n, seed)
    @given(case=http_cases(srv.token))
    def one(case):
        i = next(cases)
        if srv.proc.poll() is not None:
            return  # counted once below
        try:
            with httpx.Client(timeout=HANG_S) as client:
                r = client.post(srv.url + case.path, content=case.body, headers=list(case.headers))
            t.counts["http_cases"] += 1
            t.counts[f"http_{r.status_code}"] += 1
            if r.status_code >= 500:
                t.bad("http_5xx", f"{r.status_code} {r.text[:200]} <- {case.body[:200]!r}")
            elif r.status_code >= 400:
                body = r.json()
                t.counts["http_typed_errors"] += bool(body.get("error", {}).get("message"))
        except httpx.TimeoutException:
            t.bad("hangs", f"http {case.path} {case.body[:200]!r}")
        except httpx.TransportError as e:
            t.bad("crashes" if srv.proc.poll() is not None else "transport_errors", f"{type(e).__name__} {case}")
        if i % 100 == 0:
            t.good_checks += 1
            try:
                r = httpx.post(srv.url + "/v1/completions", headers=srv.headers, json=GOOD, timeout=HANG_S)
                t.good_ok += r.status_code == 200
            except httpx.HTTPError:
                pass

    one()


def grpc_phase(coord: ReferenceCoordinator, loop, session, n: int, seed: int, t: Tally, srv: LocalServer) -> None:
    def call(coro, timeout=HANG_S + 5):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def send(frame):
        loop.call_soon_threadsafe(coord.send, session, frame)

    def good(job_id):
        t.good_checks += 1
        send(pb.CoordinatorFrame(job_request=pb.JobRequest(job_id=job_id, model="llama-tiny", prompt="The cache",
                                                          max_tokens=3)))
        try:
            t.good_ok += call(coord.outcome(job_id, HANG_S)).WhichOneof("frame") == "job_done"
        except Exception:
            pass

    frames = itertools.count(1)

    @_campaign_settings(n * 4 // 5, seed)
    @given(req=job_requests("llama-tiny"))
    def one_request(req):
        i = next(frames)
        req.job_id = f"c-{i}"
        send(pb.CoordinatorFrame(job_request=req))
        t.counts["frames"] += 1
        try:
            out = call(coord.outcome(req.job_id, HANG_S))
        except Exception:
            t.bad("crashes" if srv.proc.poll() is not None else "hangs", f"grpc {req}")
            return
        if out.WhichOneof("frame") == "job_done":
            t.counts["grpc_done"] += 1
        elif out.job_error.cause in (pb.ERROR_CAUSE_INTERNAL, pb.ERROR_CAUSE_UNSPECIFIED):
            t.bad("grpc_internal", f"{out.job_error} <- {req}")
        else:
            t.counts["grpc_typed_errors"] += 1
        if i % 100 == 0:
            good(f"good-{i}")

    @_campaign_settings(n - n * 4 // 5, seed)
    @given(frame=garbage_frames())
    def one_garbage(frame):
        i = next(frames)
        send(frame)
        t.counts["frames"] += 1
        t.counts["garbage_frames"] += 1
        if i % 100 == 0:
            good(f"good-{i}")

    @_campaign_settings(max(1, n // 10), seed)
    @given(frame=residency_frames("llama-tiny"))
    def one_residency(frame):
        """Warm and release frames between the jobs: each answered once, typed, and the node still serving (a
        job whose model was just released loads it again)."""
        i = next(frames)
        getattr(frame, frame.WhichOneof("frame")).request_id = i
        send(frame)
        t.counts["frames"] += 1
        t.counts["residency_frames"] += 1
        try:
            call(_until(lambda: _residency_answer(coord, i) is not None))
        except Exception:
            t.bad("crashes" if srv.proc.poll() is not None else "hangs", f"residency {frame}")
            return
        answer = _residency_answer(coord, i)
        if answer.error_cause in (pb.ERROR_CAUSE_INTERNAL,) or (answer.state == "refused" and not answer.error_cause):
            t.bad("grpc_internal", f"{answer} <- {frame}")
        if i % 10 == 0:
            good(f"good-{i}")

    one_request()
    one_garbage()
    one_residency()
    good("good-last")


def _residency_answer(coord: ReferenceCoordinator, request_id: int):
    for _, kind, frame in reversed(coord.frames):
        if kind == "model_residency" and frame.model_residency.request_id == request_id:
            return frame.model_residency
    return None


async def _until(predicate, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.02)


def coordinator_attack_phase(coord: ReferenceCoordinator, loop, session, n_results: int, n_drains: int, seed: int,
                             t: Tally, srv: LocalServer):
    """Issue 36's coordinator cases. Returns the session the node is on afterwards: the Drain flood ends with the
    coordinator restarted (a drained session refuses jobs until it ends), so the node dials a new one."""
    def call(coro, timeout=HANG_S + 5):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def send(frame):
        loop.call_soon_threadsafe(coord.send, session, frame)

    def outcome(job_id):
        try:
            return call(coord.outcome(job_id, HANG_S))
        except Exception:
            t.bad("crashes" if srv.proc.poll() is not None else "hangs", f"no outcome for {job_id[:80]}")
            return None

    def protocol_error_after(before: int) -> bool:
        deadline = time.monotonic() + HANG_S
        while not any(e.frame_kind == "job_request" for e in coord.protocol_errors[before:]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # Requests past their bounds: each refused as INVALID_REQUEST, the sealed ones before their body is opened;
    # a job id past its bound with a ProtocolError that gives its length (an echo would be as large as the id).
    cases = oversized_requests("llama-tiny", "over")
    for n in (129, 1 << 16, 4 << 20):
        huge = f"over-sealed-{n}-" + "s" * n
        sealed, _ = seal_job(session.registration.sealing_key, huge, pb.JobRequest(job_id=huge, prompt="x"))
        cases.append((f"sealed_job_id_{n}", pb.JobRequest(job_id=huge, model="llama-tiny", sealed=sealed)))
    for name, req in cases:
        before = len(coord.protocol_errors)
        send(pb.CoordinatorFrame(job_request=req))
        t.counts["oversized"] += 1
        if len(req.job_id) > MAX_JOB_ID:
            if protocol_error_after(before):
                t.counts["oversized_refused"] += 1
            else:
                t.bad("crashes" if srv.proc.poll() is not None else "hangs", f"no ProtocolError for {name}")
            continue
        out = outcome(req.job_id)
        if out is not None and out.WhichOneof("frame") == "job_error" \
                and out.job_error.cause == pb.ERROR_CAUSE_INVALID_REQUEST:
            t.counts["oversized_refused"] += 1
        elif out is not None:
            t.bad("oversized_not_refused", f"{name}: {str(out)[:200]}")

    # Malformed results, against the reference coordinator's verifier: a typed refusal each, nothing raised.
    good = "attack-signed"  # dispatched: the coordinator keeps the request its result must answer
    loop.call_soon_threadsafe(coord.dispatch, session, pb.JobRequest(job_id=good, model="llama-tiny",
                                                                     prompt="The cache", max_tokens=3))
    done = outcome(good)
    if done is not None and done.WhichOneof("frame") == "job_done":
        key, request = session.registration.public_key, coord.requests[good]

        @_campaign_settings(n_results, seed)
        @given(forged=malformed_results(done.job_done))
        def one_result(forged):
            t.counts["results"] += 1
            try:
                why = coord.check_result(session, forged)
                try:
                    verify_result(forged, key, request)
                except (InvalidResult, InvalidSignature) as e:
                    why = why or str(e)
            except Exception as e:  # what would end a coordinator's reader
                t.bad("result_exceptions", f"{type(e).__name__}: {e} <- {forged}")
                return
            if why:
                t.counts["results_refused"] += 1
            elif forged.SerializeToString(deterministic=True) != done.job_done.SerializeToString(deterministic=True):
                t.bad("results_accepted", str(forged))
            else:
                t.counts["results_unchanged"] += 1  # the draw set every field to the value it had

        one_result()

    # A Drain flood while a job runs: one pending report, memory flat; then a new session to serve again.
    proc = psutil.Process(srv.proc.pid)
    rss_before = proc.memory_info().rss
    send(pb.CoordinatorFrame(job_request=pb.JobRequest(job_id="attack-running", model="llama-tiny",
                                                       prompt="The cache", max_tokens=16)))
    drain = pb.CoordinatorFrame(drain=pb.Drain()).SerializeToString()
    for i in range(n_drains):
        send(drain)
        if i % 1000 == 999:  # let the node read them: a Pong after them means every one before was read
            ping = 10**9 + i
            send(pb.CoordinatorFrame(ping=pb.Ping(id=ping)))
            deadline = time.monotonic() + HANG_S
            while not any(k == "pong" and f.pong.id == ping for _, k, f in coord.frames[-200:]):
                if time.monotonic() > deadline:
                    t.bad("hangs", f"no pong after {i + 1} Drain frames")
                    break
                time.sleep(0.01)
    outcome("attack-running")
    t.counts["drains"] += n_drains
    t.counts["drain_rss_growth_mib"] = int((proc.memory_info().rss - rss_before) / 2**20)
    before = session.session_id
    call(coord.restart())
    t.counts["deliberate_restarts"] += 1
    return call(coord.wait_for_node(60, after=before), 70)


def media_phase(n: int, seed: int, t: Tally, root: Path) -> dict:
    """Media bombs (issue 37) and hostile media variants against a vision node (the Gemma 4 fixture): every one a
    typed 4xx or served, the node's RSS never more than its idle figure + the media bound + the tower's scratch
    + 64 MiB, a normal image served after every 20 cases."""
    from PIL import Image

    from provider.media.images import MAX_MEDIA_BYTES
    from provider.memory.estimate import vision_scratch_bytes
    from tools.fixtures.vision import make_gemma4_vlm
    from tools.harness.hostile import _png, image_part

    make_gemma4_vlm(root / "media" / "gemma4-vlm")
    config = json.loads((root / "media" / "gemma4-vlm" / "config.json").read_text())
    allowed = MAX_MEDIA_BYTES + max(32 * vision_scratch_bytes(config, 70), vision_scratch_bytes(config, 280)) + (64 << 20)
    normal = [image_part(_png(Image.new("RGB", (40, 30), (200, 30, 30))))]
    srv = LocalServer(root / "media" / "gemma4-vlm", root / "media")
    out = {"peak_mib": 0.0, "allowed_mib": allowed / 2**20}
    try:
        proc = psutil.Process(srv.proc.pid)

        def post(parts: list[dict]) -> httpx.Response:
            body = {"model": "gemma4-vlm", "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}]}
            return httpx.post(srv.url + "/v1/chat/completions", headers=srv.headers, json=body, timeout=300)

        post(normal)
        idle = proc.memory_info().rss
        peak, done = [idle], threading.Event()

        def sample():
            while not done.is_set():
                try:
                    peak[0] = max(peak[0], proc.memory_info().rss)
                except psutil.Error:
                    return
                done.wait(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cases = itertools.count(1)

        def one(parts: list[dict], what: str) -> None:
            i = next(cases)
            if srv.proc.poll() is not None:
                return
            try:
                r = post(parts)
                t.counts["media_cases"] += 1
                t.counts[f"media_{r.status_code}"] += 1
                if r.status_code >= 500:
                    t.bad("media_5xx", f"{r.status_code} {r.text[:200]} <- {what}")
                elif r.status_code >= 400 and not r.json().get("error", {}).get("message"):
                    t.bad("media_untyped", f"{r.status_code} {r.text[:200]} <- {what}")
            except httpx.TimeoutException:
                t.bad("hangs", f"media {what}")
            except httpx.TransportError as e:
                t.bad("crashes" if srv.proc.poll() is not None else "transport_errors", f"{type(e).__name__} {what}")
            if i % 20 == 0:
                t.good_checks += 1
                try:
                    t.good_ok += post(normal).status_code == 200
                except httpx.HTTPError:
                    pass

        for name, parts in media_bombs():
            one(parts, name)

        @_campaign_settings(n, seed)
        @given(parts=media_cases())
        def fuzzed(parts):
            one(parts, json.dumps(parts)[:200])

        fuzzed()
        done.set()
        sampler.join()
        out["peak_mib"] = (peak[0] - idle) / 2**20
        if peak[0] - idle > allowed:
            t.bad("media_rss", f"RSS grew {out['peak_mib']:.0f} MiB over idle, more than {allowed / 2**20:.0f} MiB")
        out["alive"] = srv.proc.poll() is None
    finally:
        out["code"] = srv.stop()
        out["tracebacks"] = srv.logs().count("Traceback")
    return out


def print_media(t: Tally, m: dict, seconds: float) -> bool:
    c = t.counts
    print(f"  media bombs and hostile media (Gemma 4 fixture): {c['media_cases']} requests in {seconds:.0f} s, "
          + ", ".join(f"{k[6:]}: {v}" for k, v in sorted(c.items()) if k.startswith("media_") and k[6:].isdigit()))
    print(f"    5xx {c['media_5xx']}, untyped 4xx {c['media_untyped']}, crashes {c['crashes'] + (not m['alive'])}, "
          f"hangs {c['hangs']}, tracebacks {m['tracebacks']}  (must be 0)")
    print(f"    RSS peak over idle {m['peak_mib']:.0f} MiB (at most {m['allowed_mib']:.0f}); good image requests "
          f"{t.good_ok}/{t.good_checks} served; exit code on SIGTERM {m['code']}")
    return (not c["media_5xx"] and not c["media_untyped"] and not c["crashes"] and m["alive"] and not c["hangs"]
            and not m["tracebacks"] and not c["media_rss"] and t.good_ok == t.good_checks and m["code"] == 0)


def _stream_gaps(srv: LocalServer, max_tokens: int) -> list[float]:
    """One streamed completion on `srv`: the seconds between its chunks."""
    arrivals = []
    body = {"prompt": "The cache", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "speculation": "off"}
    with httpx.stream("POST", srv.url + "/v1/completions", headers=srv.headers, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # after the first token


def schema_phase(n: int, seed: int, t: Tally, root: Path) -> dict:
    """A stream decodes on the bundled model while requests are sent beside it: first plain twins, then
    requests with hostile schemas and tool lists. A tool list is part of the prompt (the generic format writes
    it there), so each tool request's twin carries the same text as its message: the comparison is of the
    schema's handling (checks, compile, masks, refusals), not of reading a longer prompt, which chunked
    prefill paces. The stream's longest gap beside the hostile requests over its longest beside the twins
    (goal <= 2)."""
    import random

    from tools.harness.hostile import HOSTILE_SCHEMAS

    (root / "schemas").mkdir()
    srv = LocalServer(None, root / "schemas")
    rng = random.Random(seed)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 1.0}
    pairs = [(chat | {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": sc}}}, chat)
             for sc in HOSTILE_SCHEMAS]
    for sc in HOSTILE_SCHEMAS:
        tools = [{"type": "function", "function": {"name": "f", "parameters": sc}}]
        pairs.append((chat | {"tools": tools, "tool_choice": "required"},
                      chat | {"messages": [{"role": "user", "content": "x " + json.dumps(tools)}]}))
    try:
        _stream_gaps(srv, 16)  # warm

        def beside(bodies) -> float:
            stop = threading.Event()

            def send():
                with httpx.Client(timeout=HANG_S) as client:
                    while not stop.is_set():
                        body = rng.choice(bodies)
                        try:
                            r = client.post(srv.url + "/v1/chat/completions", headers=srv.headers, json=body)
                        except httpx.HTTPError as e:
                            t.bad("schema_transport_errors", f"{type(e).__name__} <- {json.dumps(body)[:200]}")
                            continue
                        t.counts["schema_cases"] += 1
                        t.counts[f"schema_{r.status_code}"] += 1
                        if r.status_code >= 500:
                            t.bad("http_5xx", f"{r.status_code} {r.text[:200]} <- {json.dumps(body)[:200]}")
                        elif r.status_code == 400 and not r.json()["error"].get("param"):
                            t.bad("schema_4xx_without_param", r.text[:200])

            senders = [threading.Thread(target=send) for _ in range(2)]
            for th in senders:
                th.start()
            try:
                return max(max(_stream_gaps(srv, 128)) for _ in range(n))
            finally:
                stop.set()
                for th in senders:
                    th.join()

        plain = beside([twin for _, twin in pairs])
        counts = dict(t.counts)
        attacked = beside([hostile for hostile, _ in pairs])
        for key, before in counts.items():  # report the hostile requests alone
            if key.startswith("schema_"):
                t.counts[key] -= before
    finally:
        srv.stop()
    return {"plain_gap_ms": plain * 1000, "hostile_gap_ms": attacked * 1000, "ratio": attacked / plain}


def _good_job(coord: ReferenceCoordinator, loop, session, job_id: str, t: Tally) -> None:
    t.good_checks += 1
    loop.call_soon_threadsafe(coord.send, session, pb.CoordinatorFrame(job_request=pb.JobRequest(
        job_id=job_id, model="llama-tiny", prompt="The cache", max_tokens=3)))
    try:
        out = asyncio.run_coroutine_threadsafe(coord.outcome(job_id, HANG_S), loop).result(HANG_S + 5)
        t.good_ok += out.WhichOneof("frame") == "job_done"
    except Exception:
        pass


def _protocol_error_lines(log_text: str) -> int:
    return log_text.count('"coordinator_protocol_error"')


def _protocol_error_bound(node_s: float) -> float:
    """What the node's throttle lets through over its life, for each kind of unusable frame (undecodable, no
    known case, each of the three handshake frames, a bad job id)."""
    return 6 * (THROTTLE_BURST + THROTTLE_PER_S * node_s + node_s / THROTTLE_SUMMARY_S + 2)


def print_coordinator_attacks(t: Tally, seconds: float, log_text: str, node_s: float) -> None:
    c = t.counts
    print(f"  coordinator attacks in {seconds:.0f} s (issue 36)")
    print(f"    oversized requests  {c['oversized']:4d}, refused (INVALID_REQUEST, or ProtocolError for an id): "
          f"{c['oversized_refused']}  (must be all)")
    print(f"    malformed results   {c['results']:4d}, typed refusals: {c['results_refused']} (unchanged by their "
          f"draw: {c['results_unchanged']}), exceptions: {c['result_exceptions']}  (must be 0)")
    print(f"    Drain frames      {c['drains']:6d}, node RSS growth {c['drain_rss_growth_mib']:+d} MiB")
    print(f"    malformed results accepted: {c['results_accepted']}  (must be 0)")
    print(f"    log lines for unusable frames: {_protocol_error_lines(log_text)} for {c['garbage_frames']} garbage "
          f"frames (throttle's bound over the node's {node_s:.0f} s: {_protocol_error_bound(node_s):.0f}), "
          f"{log_text.count('log_suppressed')} log_suppressed lines")


def coordinator_attacks_ok(t: Tally, log_text: str, node_s: float) -> bool:
    c = t.counts
    return (c["oversized_refused"] == c["oversized"] and not c["oversized_not_refused"]
            and not c["result_exceptions"] and not c["results_accepted"] and c["results_refused"] > 0
            and _protocol_error_lines(log_text) <= _protocol_error_bound(node_s))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--http", type=int, default=2000, help="HTTP cases (default 2000)")
    ap.add_argument("--frames", type=int, default=1000, help="coordinator frames (default 1000)")
    ap.add_argument("--seed", type=int, default=int(time.time()), help="hypothesis seed (default: the time)")
    ap.add_argument("--streams", type=int, default=3,
                    help="streams measured beside plain and beside hostile-schema requests (default 3)")
    ap.add_argument("--results", type=int, default=500,
                    help="malformed results given to the reference coordinator's verifier (default 500)")
    ap.add_argument("--drains", type=int, default=20_000, help="Drain frames in the flood (default 20000)")
    ap.add_argument("--group", type=int, default=1000,
                    help="hostile cases per part of a node group's wire (rendezvous, wake-up port, plans; default 1000)")
    ap.add_argument("--media", type=int, default=200, help="hostile media requests after the bombs (default 200)")
    ap.add_argument("--media-only", action="store_true", help="run only the media phase (bombs and hostile media)")
    ap.add_argument("--floods-only", action="store_true", help="run only issue 56's floods")
    args = ap.parse_args()
    if args.floods_only:
        with tempfile.TemporaryDirectory() as tmp:
            floods, end = flood_phase(Path(tmp) / "floods")
        print("fuzz campaign, floods phase")
        ok = print_floods(floods, end)
        print("verdict:", "ok" if ok else "FAILED")
        return 0 if ok else 1
    if args.media_only:
        t = Tally()
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            m = media_phase(args.media, args.seed, t, Path(tmp))
            print(f"fuzz campaign (seed {args.seed}), media phase")
            ok = print_media(t, m, time.monotonic() - started)
        for kind, example in t.examples.items():
            print(f"  first {kind}: {example}")
        print("verdict:", "ok" if ok else "FAILED")
        return 0 if ok else 1
    if args.http < 1 or args.frames < 5 or args.results < 1 or args.drains < 1 or args.group < 1:
        ap.error("--http, --results, --drains and --group must be >= 1 and --frames >= 5")

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    coord = ReferenceCoordinator(heartbeat_interval_ms=1000)
    asyncio.run_coroutine_threadsafe(coord.start(), loop).result(30)
    t = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        factory.write_all(root / "fixtures")
        node_started = time.monotonic()
        srv = LocalServer(root / "fixtures" / "llama-tiny", root, "--coordinator", coord.url,
                          env={"PROVIDER_MAX_TOKENS_LIMIT": "16", "PROVIDER_DEFAULT_MAX_TOKENS": "4"})
        try:
            session = asyncio.run_coroutine_threadsafe(coord.wait_for_node(60), loop).result(70)
            proc = psutil.Process(srv.proc.pid)
            rss_start = proc.memory_info().rss
            started = time.monotonic()
            http_phase(srv, args.http, args.seed, t)
            agents_started = time.monotonic()
            t.counts["agent_cases"], bad = agent_failures(srv.url, srv.headers, "llama-tiny", HANG_S)
            for name, detail in bad:  # a 5xx, a 4xx not in its API's own shape, a hang or a dropped connection
                t.bad("agent_bad", f"{name}: {detail}")
            agents_s = time.monotonic() - agents_started
            http_s = time.monotonic() - started
            grpc_phase(coord, loop, session, args.frames, args.seed, t, srv)
            grpc_s = time.monotonic() - started - http_s
            session = coordinator_attack_phase(coord, loop, session, args.results, args.drains, args.seed, t, srv)
            _good_job(coord, loop, session, "good-after-attacks", t)
            attacks_s = time.monotonic() - started - http_s - grpc_s
            gaps = schema_phase(args.streams, args.seed, t, root)
            alive = srv.proc.poll() is None
            rss_end = proc.memory_info().rss if alive else 0
            sessions = len({sid for sid, *_ in coord.frames})
        finally:
            code = srv.stop()
        node_s = time.monotonic() - node_started
        log_text = srv.logs()
        group_started = time.monotonic()
        group = group_campaign(args.group, args.seed, root / "group")
        group_s = time.monotonic() - group_started
        media_tally, media_started = Tally(), time.monotonic()
        media = media_phase(args.media, args.seed, media_tally, root)
        media_s = time.monotonic() - media_started
        floods, floods_end = flood_phase(root / "floods")
    c = t.counts
    crashes = c["crashes"] + (not alive)
    print(f"fuzz campaign (seed {args.seed}) against a live node daemon, llama-tiny (vocabulary 512)")
    print(f"  HTTP cases          {c['http_cases']:6d}  in {http_s:.0f} s")
    print(f"    2xx               {c['http_200']:6d}")
    print(f"    4xx typed errors  {c['http_typed_errors']:6d}  "
          + ", ".join(f"{k[5:]}: {v}" for k, v in sorted(c.items()) if k.startswith("http_4")))
    print(f"    5xx               {c['http_5xx']:6d}  (must be 0)")
    print(f"  agent API cases     {c['agent_cases']:6d}  in {agents_s:.0f} s (/v1/messages, count_tokens, /v1/responses)")
    print(f"    5xx, hangs or errors not in the API's own shape {c['agent_bad']:6d}  (must be 0)")
    print(f"  coordinator frames  {c['frames']:6d}  in {grpc_s:.0f} s ({c['garbage_frames']} garbage/truncated, "
          f"{c['residency_frames']} warm/release)")
    print(f"    JobDone           {c['grpc_done']:6d}")
    print(f"    typed JobErrors   {c['grpc_typed_errors']:6d}")
    print(f"    INTERNAL          {c['grpc_internal']:6d}  (must be 0)")
    print(f"  hostile schemas and tool lists beside a stream (bundled model): {c['schema_cases']} requests, "
          + ", ".join(f"{k[7:]}: {v}" for k, v in sorted(c.items()) if k.startswith("schema_") and k[7:].isdigit()))
    print(f"    the stream's longest gap: {gaps['plain_gap_ms']:.1f} ms beside their plain twins, "
          f"{gaps['hostile_gap_ms']:.1f} ms beside hostile ones: x{gaps['ratio']:.2f}  (goal <= 2)")
    tracebacks = log_text.count("Traceback")
    print_coordinator_attacks(t, attacks_s, log_text, node_s)
    print(f"  a node group's wire: {group.cases} hostile cases in {group_s:.0f} s (lines at the rendezvous and the "
          f"wake-up port, sealed plans)")
    print(f"    typed refusals    {group.refused:6d}  (plans; lines are refused by the ranks, logged)")
    print(f"    hostile JSON that was still a plan a request could make: {group.accepted}")
    print(f"    honest meetings   {group.meetings:6d}  (must be 6: two rendezvous of two ranks, one wake-up)")
    print(f"    exceptions {len(group.crashes)}, hangs {group.hangs}, error logs {group.error_logs}  (must be 0)")
    for crash in group.crashes[:3]:
        print(f"    first exceptions: {crash}")
    media_ok = print_media(media_tally, media, media_s)
    floods_ok = print_floods(floods, floods_end)
    print(f"  crashes             {crashes:6d}  (must be 0)")
    print(f"  tracebacks in the node's log {tracebacks:3d}  (must be 0)")
    print(f"  hangs (> {HANG_S:.0f} s)      {c['hangs']:6d}  (must be 0)")
    print(f"  good request after every 100 cases: {t.good_ok}/{t.good_checks} served")
    expected_sessions = 1 + c["deliberate_restarts"]
    print(f"  coordinator sessions: {sessions} ({expected_sessions} = the stream dropped only when the coordinator "
          "restarted on purpose)")
    print(f"  node RSS {rss_start / 2**20:.0f} MiB -> {rss_end / 2**20:.0f} MiB "
          f"({(rss_end - rss_start) / 2**20:+.0f} MiB); exit code on SIGTERM {code}")
    for kind, example in t.examples.items():
        print(f"  first {kind}: {example}")
    ok = (not c["http_5xx"] and not c["agent_bad"] and not c["grpc_internal"] and not crashes and not c["hangs"] and not tracebacks
          and t.good_ok == t.good_checks and code == 0 and gaps["ratio"] <= 2
          and coordinator_attacks_ok(t, log_text, node_s)
          and group.meetings == 6 and not group.crashes and not group.hangs and not group.error_logs and media_ok
          and floods_ok)
    print("verdict:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
