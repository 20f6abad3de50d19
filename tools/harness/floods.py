"""Issue 56's floods against a live node (`provider start --local --coordinator`, the bundled model), each
measured by what answers beside it: /health's latency and a coordinator Ping's round trip, sampled every 10 ms
while the flood runs, and the node's RSS; and a bare aiohttp server's /health meanwhile, for the machine's own
share of any latency. Used by tools/scripts/fuzz_campaign.py (--floods-only, and after the media phase).

Each flood is sent for 15 s by a process of its own, so its senders hold none of the probes' interpreter. The
floods: count_tokens and /tokenize with 2.6 MB prompts; chats of 99,999 and of 9,999 empty messages; 150,000
and 600 tiny tools (/v1/messages, /v1/responses, Chat Completions); values nested 940-999 deep in temperature and
in Responses metadata; previous_response_id chains of 2 MB requests of left-out items. Expected: 0 5xx, /health
and the Ping answered within 100 ms at the 99th percentile during each, RSS bounded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from tools.harness.daemon import LocalServer
from tools.harness.privacy_probes import ProbeReport, origin_probe, planted_probe, sealed_probe

MODEL = "gemma4-demo"
SENDERS = 4  # requests in flight at once
SECONDS = 15.0  # each flood's requests are sent over and over for this long
# A bare aiohttp server in its own process, asked for /health beside the node's: what the machine's own load
# (other processes, this harness) adds to any latency, the node's or not.
CONTROL = """
import sys
from aiohttp import web
async def health(request):
    return web.json_response({"status": "ok"})
app = web.Application()
app.add_routes([web.get("/health", health)])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


@dataclass
class Flood:
    name: str
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    health_ms: list[float] = field(default_factory=list)
    ping_ms: list[float] = field(default_factory=list)
    control_ms: list[float] = field(default_factory=list)  # the bare server's /health meanwhile
    seconds: float = 0.0
    rss_peak_mib: float = 0.0  # over the node's RSS before the floods

    @staticmethod
    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def ok(self) -> bool:
        # a status is an HTTP code, or the name of the error a request ended with (no answer): a failure too
        return (not any(isinstance(s, str) or s >= 500 for s in self.statuses) and self.pct(self.health_ms, 0.99) < 100
                and self.pct(self.ping_ms, 0.99) < 100)

    def line(self) -> str:
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0])))
        return (f"{self.name:24s} {self.requests:4d} requests in {self.seconds:5.1f} s ({codes}); /health p50 "
                f"{self.pct(self.health_ms, .5):5.1f} p99 {self.pct(self.health_ms, .99):6.1f} max "
                f"{max(self.health_ms, default=0):6.1f} ms ({len(self.health_ms)}); Ping p99 "
                f"{self.pct(self.ping_ms, .99):6.1f} max {max(self.ping_ms, default=0):6.1f} ms; a bare server's "
                f"/health p99 {self.pct(self.control_ms, .99):6.1f} max {max(self.control_ms, default=0):6.1f} ms; RSS peak "
                f"+{self.rss_peak_mib:.0f} MiB")


def _bodies() -> dict[str, list[tuple[str, bytes]]]:
    """Each flood's requests, encoded once."""
    text = "word " * 520_000
    enc = lambda b: json.dumps(b).encode()  # noqa: E731
    turns = lambda n: [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(n)]  # noqa: E731
    ask = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    tiny = [{"name": f"t{i}", "input_schema": {}} for i in range(150_000)]
    deep = lambda d: b"[" * d + b"1" + b"]" * d  # noqa: E731
    chat = enc(ask | {"temperature": 0})
    meta = enc({"model": MODEL, "input": "Hi", "max_output_tokens": 1, "metadata": {"m": 0}})
    return {
        "count_tokens": [("/v1/messages/count_tokens", enc({"model": MODEL, "messages": [{"role": "user",
                                                                                        "content": text}]})),
                         ("/tokenize", enc({"model": MODEL, "prompt": text}))] * 8,
        "empty_messages": [("/v1/chat/completions", enc(ask | {"messages": turns(99_999)})),
                           ("/v1/messages", enc(ask | {"messages": [{"role": "user", "content": "x"}] * 99_999})),
                           # ~50k tokens templated, past the bundled model's context (4,999 turns fit it:
                           # a lawful prompt, minutes of prefill on a CPU, which no flood should send)
                           ("/v1/chat/completions", enc(ask | {"messages": turns(9_999)}))] * 4,
        "tools": [("/v1/messages", enc(ask | {"tools": tiny})), ("/v1/messages", enc(ask | {"tools": tiny[:600]})),
                  ("/v1/chat/completions", enc(ask | {"tools": [{"type": "function", "function": t}
                                                                for t in tiny]}))] * 4,
        "deep_nesting": [("/v1/chat/completions", chat.replace(b'"temperature": 0', b'"temperature": ' + deep(d)))
                         for d in range(940, 1000)]
        + [("/v1/responses", meta.replace(b'{"m": 0}', b'{"m": ' + deep(d) + b"}")) for d in range(940, 1000)],
    }


def _chain_turn(previous: str | None) -> bytes:
    """2 MB of left-out items (reasoning items carrying text) and one short user message."""
    body = {"model": MODEL, "max_output_tokens": 1, "temperature": 0,
            "input": [{"type": "reasoning", "summary": [], "note": "x" * 200}] * 9_000
            + [{"role": "user", "content": "Hi"}]}
    return json.dumps(body | ({"previous_response_id": previous} if previous else {})).encode()


class Probes:
    """/health and a coordinator Ping, each asked every 10 ms, and the node's RSS, while a flood runs."""

    def __init__(self, srv: LocalServer, coord: ReferenceCoordinator, loop, session, control: str):
        self.srv, self.coord, self.loop, self.session, self.control = srv, coord, loop, session, control
        self.proc = psutil.Process(srv.proc.pid)
        self.idle_rss = self.proc.memory_info().rss
        self._ping = 10**6

    def during(self, flood: Flood, work) -> None:
        done = threading.Event()
        peak = [self.idle_rss]

        def health(url, out, rss):
            with httpx.Client(timeout=120) as c:
                while not done.is_set():
                    t0 = time.perf_counter()
                    c.get(url + "/health")
                    out.append((time.perf_counter() - t0) * 1000)
                    if rss:
                        peak[0] = max(peak[0], self.proc.memory_info().rss)
                    done.wait(0.01)

        def ping():
            while not done.is_set():
                self._ping += 1
                i, seen = self._ping, len(self.coord.frames)
                t0 = time.perf_counter()
                self.loop.call_soon_threadsafe(self.coord.send, self.session, pb.CoordinatorFrame(ping=pb.Ping(id=i)))
                while not any(k == "pong" and f.pong.id == i for _, k, f in self.coord.frames[seen:]):
                    time.sleep(0.0005)
                    if time.perf_counter() - t0 > 60:
                        break
                flood.ping_ms.append((time.perf_counter() - t0) * 1000)
                done.wait(0.01)

        probes = [threading.Thread(target=health, args=(self.srv.url, flood.health_ms, True)),
                  threading.Thread(target=health, args=(self.control, flood.control_ms, False)),
                  threading.Thread(target=ping)]
        for p in probes:
            p.start()
        started = time.monotonic()
        try:
            work()
        finally:
            flood.seconds = time.monotonic() - started
            done.set()
            for p in probes:
                p.join()
        flood.rss_peak_mib = (peak[0] - self.idle_rss) / 2**20


@dataclass(frozen=True)
class Target:
    url: str
    headers: dict


def _send(srv: Target, flood: Flood, path: str, body: bytes) -> httpx.Response | None:
    try:
        r = httpx.post(srv.url + path, content=body, timeout=300,
                       headers={**srv.headers, "Content-Type": "application/json"})
    except httpx.HTTPError as e:
        flood.statuses[type(e).__name__] += 1
        return None
    flood.requests += 1
    flood.statuses[r.status_code] += 1
    return r


def _repeat(srv: Target, flood: Flood, requests: list[tuple[str, bytes]]) -> None:
    """`requests` sent by SENDERS threads, over and over, for SECONDS."""
    deadline = time.monotonic() + SECONDS

    def sender(k):
        i = k
        while time.monotonic() < deadline:
            _send(srv, flood, *requests[i % len(requests)])
            i += SENDERS

    with ThreadPoolExecutor(SENDERS) as pool:
        list(pool.map(sender, range(SENDERS)))


def _chains(srv: Target, flood: Flood, links: int = 12) -> None:
    """Chains of `links` 2 MB turns, SENDERS at once, begun anew for SECONDS."""
    deadline = time.monotonic() + SECONDS

    def chain(_):
        while time.monotonic() < deadline:
            previous = None
            for _ in range(links):
                if time.monotonic() > deadline + SECONDS:  # a node that keeps growing them: end the flood anyway
                    return
                r = _send(srv, flood, "/v1/responses", _chain_turn(previous))
                if r is None or r.status_code != 200:
                    break
                previous = r.json()["id"]

    with ThreadPoolExecutor(SENDERS) as pool:
        list(pool.map(chain, range(SENDERS)))


def _flood(srv: LocalServer, flood: Flood, bodies: Path) -> None:
    """One flood, sent by a process of its own: its senders' work (json, sockets, the interpreter they hold) is
    not the probes'. `bodies`: a directory of requests (index.json: [path, file] each), or none for chains."""
    out = subprocess.run([sys.executable, "-m", "tools.harness.floods", srv.url, json.dumps(srv.headers),
                          str(bodies)], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    got = json.loads(out.stdout)
    flood.requests, flood.statuses = got["requests"], Counter({int(k) if k.isdigit() else k: v
                                                               for k, v in got["statuses"].items()})


def _written(root: Path, name: str, requests: list[tuple[str, bytes]]) -> Path:
    where = root / "bodies" / name
    where.mkdir(parents=True, exist_ok=True)
    index = []
    for i, (path, body) in enumerate(requests):
        (where / f"{i}.json").write_bytes(body)
        index.append([path, f"{i}.json"])
    (where / "index.json").write_text(json.dumps(index))
    return where


def flood_phase(root: Path) -> tuple[list[Flood], dict]:
    """Every flood against one node, one after the other; returns them and the node's end state."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    call = lambda coro, timeout=120: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)  # noqa: E731
    coord = ReferenceCoordinator(heartbeat_interval_ms=1000)
    call(coord.start())
    root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    control = subprocess.Popen([sys.executable, "-c", CONTROL, str(port)])
    srv = LocalServer(None, root, "--coordinator", coord.url)
    floods, end = [], {}
    try:
        for _ in range(300):  # the bare server is up long before the node
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        session = call(coord.wait_for_node(60), 70)
        bodies = _bodies()
        _send(Target(srv.url, srv.headers), Flood("warm"), "/v1/chat/completions", json.dumps(
            {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).encode())
        probes = Probes(srv, coord, loop, session, f"http://127.0.0.1:{port}")
        quiet = Flood("(none: idle)")
        probes.during(quiet, lambda: time.sleep(SECONDS))
        floods.append(quiet)
        for name, requests in [*bodies.items(), ("response_chains", [])]:
            flood, where = Flood(name), _written(root, name, requests)
            probes.during(flood, lambda flood=flood, where=where: _flood(srv, flood, where))
            floods.append(flood)
        health = httpx.get(srv.url + "/health", timeout=60).json()
        end = {"alive": srv.proc.poll() is None, "store_bytes": health["memory"].get("responses_store_bytes"),
               "rss_mib": probes.proc.memory_info().rss / 2**20, "idle_rss_mib": probes.idle_rss / 2**20}
        report = end["probes"] = ProbeReport()
        report.sealed = sealed_probe(coord, call, session)
        origin_probe(srv.url, srv.headers, report)
        tracebacks = _tracebacks(srv.logs())

        def restart() -> LocalServer:
            nonlocal srv
            srv = LocalServer(None, root, "--coordinator", coord.url)
            return srv

        report.planted = planted_probe(srv, restart, lambda s: s.headers)
        report.planted.pop("srv", None)
    finally:
        control.terminate()
        end["code"] = srv.stop()
        end["tracebacks"] = _tracebacks(srv.logs()) + locals().get("tracebacks", Counter())
        call(coord.kill())
    return floods, end


def _tracebacks(log: str) -> Counter:
    """The node's tracebacks by what each ended with (the error's line), so a failed run says what failed."""
    found = Counter()
    for block in log.replace("\\n", "\n").split("Traceback (most recent call last):")[1:]:  # JSON lines too
        lines = [ln for ln in block.splitlines() if ln and not ln.startswith((" ", "\t"))]
        found[(lines[0] if lines else "?")[:200]] += 1
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_floods(floods: list[Flood], end: dict, rss_bound_mib: float = 512) -> bool:
    print("  issue 56's floods (bundled model, the node on a coordinator session): what answers beside each")
    for f in floods:
        print("    " + f.line())
    print(f"    node RSS idle {end.get('idle_rss_mib', 0):.0f} MiB, after {end.get('rss_mib', 0):.0f} MiB; stored "
          f"responses {end.get('store_bytes')} bytes; tracebacks {sum(end.get('tracebacks', Counter()).values())}; "
          f"exit code {end.get('code')}")
    for error, count in end.get("tracebacks", Counter()).items():
        print(f"      {count} x {error}")
    report = end.get("probes")
    for line in report.lines() if report else ["the probes did not run"]:
        print("    " + line)
    ok = (all(f.ok for f in floods) and end.get("alive") and end.get("code") == 0 and not end.get("tracebacks")
          and all(f.rss_peak_mib < rss_bound_mib for f in floods) and report is not None and report.ok)
    print(f"    0 5xx, /health and Ping p99 < 100 ms during each, RSS peak < +{rss_bound_mib:.0f} MiB, no sealed "
          "prompt found, no cross-origin or rebinding request served, no planted file used: "
          f"{'ok' if ok else 'FAILED'}")
    return bool(ok)


if __name__ == "__main__":  # a flood's senders: URL HEADERS DIR; prints {"requests", "statuses"}
    target, flood = Target(sys.argv[1], json.loads(sys.argv[2])), Flood("sent")
    index = json.loads((Path(sys.argv[3]) / "index.json").read_text())
    if index:
        _repeat(target, flood, [(path, (Path(sys.argv[3]) / name).read_bytes()) for path, name in index])
    else:
        _chains(target, flood)
    print(json.dumps({"requests": flood.requests, "statuses": {str(k): v for k, v in flood.statuses.items()}}))
