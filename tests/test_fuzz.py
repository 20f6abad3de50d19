"""Property-based fuzzing of a live node (bounded for the suite; tools/scripts/fuzz_campaign.py runs the long campaign).

Over HTTP: hostile bodies and headers against `provider start --local`. Over gRPC: hostile JobRequests and
garbage frames from the reference coordinator. Every case ends in a 2xx/4xx or a typed outcome, never a
5xx, an INTERNAL, a hang or a crash, and the node serves a good request afterwards.
"""

import asyncio
import itertools
import threading
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator_client.pb import provider_pb2 as pb
from tools.harness.nodes import harness, job
from tests.helpers import LocalServer
from tools.harness.hostile import BOUNDARY_IDS, garbage_frames, http_cases, job_requests, token_ids

# Short generations, so valid cases are cheap; derandomized, so the suite is the same run to run.
SHORT = {"PROVIDER_MAX_TOKENS_LIMIT": "16", "PROVIDER_DEFAULT_MAX_TOKENS": "4"}
SUITE = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HTTP_OK = {200, 400, 401, 404, 413, 415}
TYPED = set(pb.ErrorCause.values()) - {pb.ERROR_CAUSE_UNSPECIFIED, pb.ERROR_CAUSE_INTERNAL}


@pytest.fixture(scope="module")
def server(fixtures_dir, tmp_path_factory):
    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path_factory.mktemp("fuzz-http"), env=SHORT)
    yield srv
    assert srv.stop() == 0


def _good(url, headers):
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                   json={"prompt": "The cache", "max_tokens": 2, "temperature": 0.7})
    assert r.status_code == 200, r.text


def test_http_fuzz(server):
    token = server.token

    @SUITE
    @given(case=http_cases(token))
    def one(case):
        with httpx.Client(timeout=60) as client:
            r = client.post(server.url + case.path, content=case.body, headers=list(case.headers))
        assert r.status_code in HTTP_OK, (r.status_code, r.text[:300], case)
        if not case.authorized:
            assert r.status_code == 401
        if r.status_code != 200:
            assert r.json()["error"]["message"]
        assert server.proc.poll() is None, "the node died"

    one()
    _good(server.url, server.headers)


VOCAB = 512  # llama-tiny's


def test_http_token_id_fuzz(server):
    """Token ids reach native code that indexes with them: each id must be checked against the vocabulary."""

    @settings(SUITE, max_examples=80)
    @given(bias=st.dictionaries(token_ids.filter(lambda t: t >= 0), st.floats(-100, 100), max_size=3),
           stops=st.lists(token_ids.filter(lambda t: t >= 0), max_size=3), temperature=st.sampled_from([0, 0.7]))
    def one(bias, stops, temperature):
        body = {"prompt": "The cache", "max_tokens": 2, "temperature": temperature,
                "logit_bias": {str(t): b for t, b in bias.items()}, "stop_token_ids": stops}
        r = httpx.post(server.url + "/v1/completions", headers=server.headers, json=body, timeout=60)
        outside = [t for t in [*bias, *stops] if t >= VOCAB]
        assert r.status_code == (400 if outside else 200), (r.status_code, r.text[:300], body)
        if outside:
            assert r.json()["error"]["param"] in ("logit_bias", "stop_token_ids")

    one()
    assert server.proc.poll() is None


@pytest.fixture(scope="module")
def coordinated(fixtures_dir, tmp_path_factory):
    """A node with a live session to the reference coordinator, on an event loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    ctx = harness({"llama-tiny": fixtures_dir / "llama-tiny"}, tmp_path_factory.mktemp("fuzz-grpc"),
                  max_tokens_limit=16, default_max_tokens=4)
    coord, node, session = call(ctx.__aenter__())
    s = call(coord.wait_for_node())
    send = lambda frame: loop.call_soon_threadsafe(coord.send, s, frame)  # noqa: E731
    yield SimpleNamespace(call=call, send=send, coord=coord, node=node, session=session, s=s)
    call(ctx.__aexit__(None, None, None))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _good_job(c, job_id):
    c.send(pb.CoordinatorFrame(job_request=job(job_id, "llama-tiny", max_tokens=3)))
    assert c.call(c.coord.outcome(job_id)).WhichOneof("frame") == "job_done"


async def _pong(coord, ping_id: int, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not any(kind == "pong" and f.pong.id == ping_id for _, kind, f in coord.frames[-50:]):
        assert asyncio.get_running_loop().time() < deadline, f"no pong {ping_id}"
        await asyncio.sleep(0.01)


def test_grpc_job_request_fuzz(coordinated):
    c = coordinated
    ids = itertools.count()

    @SUITE
    @given(req=job_requests("llama-tiny"))
    def one(req):
        n = next(ids)
        req.job_id = f"fz-{n}" if n % 10 else "x" * 130 + str(n)  # now and then an id too long
        before = len(c.coord.protocol_errors)
        c.send(pb.CoordinatorFrame(job_request=req))
        if n % 10 == 0:  # answered with a ProtocolError giving its length, never echoed (docs/protocol.md)
            c.send(pb.CoordinatorFrame(ping=pb.Ping(id=n)))  # its Pong comes after the ProtocolError
            c.call(_pong(c.coord, n))
            assert [e.frame_kind for e in c.coord.protocol_errors[before:]] == ["job_request"]
            return
        out = c.call(c.coord.outcome(req.job_id))
        if out.WhichOneof("frame") == "job_error":
            assert out.job_error.cause in TYPED, (out.job_error, req)
            assert out.job_error.message

    one()
    _good_job(c, "after-requests")
    assert c.session.stats.sessions == 1  # the stream never dropped
    assert c.node.healthy


def test_grpc_token_id_and_top_k_fuzz(coordinated):
    c = coordinated
    ids = itertools.count()

    @settings(SUITE, max_examples=60)
    @given(stops=st.lists(st.one_of(st.sampled_from([t for t in BOUNDARY_IDS if t < 2**32]),
                                    st.integers(0, 2**32 - 1)), max_size=3),
           top_k=st.one_of(st.sampled_from([0, 1, VOCAB - 1, VOCAB, VOCAB + 1, 2**32 - 1]),
                           st.integers(0, 2**32 - 1)))
    def one(stops, top_k):
        req = job(f"tk-{next(ids)}", "llama-tiny", max_tokens=2, temperature=0.7, stop_token_ids=stops)
        req.sampling.top_k = top_k
        c.send(pb.CoordinatorFrame(job_request=req))
        out = c.call(c.coord.outcome(req.job_id))
        if any(t >= VOCAB for t in stops):
            assert out.job_error.cause == pb.ERROR_CAUSE_INVALID_REQUEST, out
        else:  # any top_k is served: at or past the vocabulary it means no top-k
            assert out.WhichOneof("frame") == "job_done", out

    one()
    assert c.node.healthy


def test_grpc_garbage_frame_fuzz(coordinated):
    c = coordinated
    before = c.session.stats.garbled_frames

    @settings(SUITE, max_examples=60)
    @given(frame=garbage_frames())
    def one(frame):
        c.send(frame)

    one()
    _good_job(c, "after-garbage")  # frames are handled in order: every garbage frame was read before it
    assert c.session.stats.garbled_frames > before
    assert c.session.stats.sessions == 1
