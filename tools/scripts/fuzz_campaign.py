"""A long fuzz campaign against a live node daemon, over both front ends; prints what happened.

The node runs as `provider start --local --coordinator grpc://127.0.0.1:PORT` (a real process, llama-tiny,
vocabulary 512) with the reference coordinator in this process. Hostile HTTP requests and hostile coordinator
frames come from tools/harness/hostile.py (the fuzz tests' strategies, unbounded here). A good request is sent after
every 100 cases. Expected: 0 5xx, 0 INTERNAL, 0 crashes, 0 hangs, every good request served.

    python tools/scripts/fuzz_campaign.py [--http 2000] [--frames 1000] [--seed N]
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

from coordinator_client.pb import provider_pb2 as pb  # noqa: E402
from coordinator_client.reference_coordinator import ReferenceCoordinator  # noqa: E402
from provider.models import fixtures  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402
from tools.harness.hostile import garbage_frames, http_cases, job_requests  # noqa: E402

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

    one_request()
    one_garbage()
    good("good-last")


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
                            t.bad("schema_transport_errors", f"{type(e).__name__}")
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--http", type=int, default=2000, help="HTTP cases (default 2000)")
    ap.add_argument("--frames", type=int, default=1000, help="coordinator frames (default 1000)")
    ap.add_argument("--seed", type=int, default=int(time.time()), help="hypothesis seed (default: the time)")
    ap.add_argument("--streams", type=int, default=3,
                    help="streams measured beside plain and beside hostile-schema requests (default 3)")
    args = ap.parse_args()
    if args.http < 1 or args.frames < 5:
        ap.error("--http must be >= 1 and --frames >= 5")

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    coord = ReferenceCoordinator(heartbeat_interval_ms=1000)
    asyncio.run_coroutine_threadsafe(coord.start(), loop).result(30)
    t = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fixtures.write_all(root / "fixtures")
        srv = LocalServer(root / "fixtures" / "llama-tiny", root, "--coordinator", coord.url,
                          env={"PROVIDER_MAX_TOKENS_LIMIT": "16", "PROVIDER_DEFAULT_MAX_TOKENS": "4"})
        try:
            session = asyncio.run_coroutine_threadsafe(coord.wait_for_node(60), loop).result(70)
            proc = psutil.Process(srv.proc.pid)
            rss_start = proc.memory_info().rss
            started = time.monotonic()
            http_phase(srv, args.http, args.seed, t)
            http_s = time.monotonic() - started
            grpc_phase(coord, loop, session, args.frames, args.seed, t, srv)
            grpc_s = time.monotonic() - started - http_s
            gaps = schema_phase(args.streams, args.seed, t, root)
            alive = srv.proc.poll() is None
            rss_end = proc.memory_info().rss if alive else 0
            sessions = len({sid for sid, *_ in coord.frames})
        finally:
            code = srv.stop()
    c = t.counts
    crashes = c["crashes"] + (not alive)
    print(f"fuzz campaign (seed {args.seed}) against a live node daemon, llama-tiny (vocabulary 512)")
    print(f"  HTTP cases          {c['http_cases']:6d}  in {http_s:.0f} s")
    print(f"    2xx               {c['http_200']:6d}")
    print(f"    4xx typed errors  {c['http_typed_errors']:6d}  "
          + ", ".join(f"{k[5:]}: {v}" for k, v in sorted(c.items()) if k.startswith("http_4")))
    print(f"    5xx               {c['http_5xx']:6d}  (must be 0)")
    print(f"  coordinator frames  {c['frames']:6d}  in {grpc_s:.0f} s ({c['garbage_frames']} garbage/truncated)")
    print(f"    JobDone           {c['grpc_done']:6d}")
    print(f"    typed JobErrors   {c['grpc_typed_errors']:6d}")
    print(f"    INTERNAL          {c['grpc_internal']:6d}  (must be 0)")
    print(f"  hostile schemas and tool lists beside a stream (bundled model): {c['schema_cases']} requests, "
          + ", ".join(f"{k[7:]}: {v}" for k, v in sorted(c.items()) if k.startswith("schema_") and k[7:].isdigit()))
    print(f"    the stream's longest gap: {gaps['plain_gap_ms']:.1f} ms beside their plain twins, "
          f"{gaps['hostile_gap_ms']:.1f} ms beside hostile ones: x{gaps['ratio']:.2f}  (goal <= 2)")
    print(f"  crashes             {crashes:6d}  (must be 0)")
    print(f"  hangs (> {HANG_S:.0f} s)      {c['hangs']:6d}  (must be 0)")
    print(f"  good request after every 100 cases: {t.good_ok}/{t.good_checks} served")
    print(f"  coordinator sessions: {sessions} (1 = the stream never dropped)")
    print(f"  node RSS {rss_start / 2**20:.0f} MiB -> {rss_end / 2**20:.0f} MiB "
          f"({(rss_end - rss_start) / 2**20:+.0f} MiB); exit code on SIGTERM {code}")
    for kind, example in t.examples.items():
        print(f"  first {kind}: {example}")
    ok = (not c["http_5xx"] and not c["grpc_internal"] and not crashes and not c["hangs"]
          and t.good_ok == t.good_checks and code == 0 and gaps["ratio"] <= 2)
    print("verdict:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
