"""`provider start --local` as a subprocess, hit by real clients (openai SDK, httpx, curl)."""

import json
import shutil
import signal
import subprocess
import threading

import httpx
import openai
import pytest

from tests import reference
from tests.helpers import LocalServer, until_blocking

MARKER = "zebra-marker-7f3a"  # must never appear in logs


@pytest.fixture(scope="module")
def server(fixtures_dir, tmp_path_factory):
    srv = LocalServer(fixtures_dir / "gemma4-tiny", tmp_path_factory.mktemp("node"))
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.token, max_retries=0)


def test_openai_sdk_chat_non_streaming(client):
    r = client.chat.completions.create(model="gemma4-tiny", messages=[{"role": "user", "content": MARKER}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 0
    t = r.model_extra["telemetry"]
    # gemma4-tiny could speculate, but this node was given no assistant for it.
    assert t["ttft_ms"] > 0 and t["speculation"] == {"mode": "off", "reason": "no_drafter"}
    assert {"prefill_tokens_per_s", "decode_tokens_per_s"} <= t.keys()


def test_openai_sdk_chat_streaming(client):
    stream = client.chat.completions.create(model="gemma4-tiny", messages=[{"role": "user", "content": MARKER}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].model_extra["telemetry"]["ttft_ms"] > 0
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.model_extra["telemetry"]["decode_tokens_per_s"] > 0


def test_openai_sdk_completions(client):
    r = client.completions.create(model="gemma4-tiny", prompt="The cache", max_tokens=6, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 6
    streamed = client.completions.create(model="gemma4-tiny", prompt="The cache", max_tokens=6, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_a_repeated_system_prompt_is_reported_as_cached_tokens(client):
    system = {"role": "system", "content": "You answer questions about caches and batches. " * 8}
    usages = [client.chat.completions.create(model="gemma4-tiny", max_tokens=4, temperature=0, messages=[
        system, {"role": "user", "content": q}]).usage for q in ("What is a cache?", "What is a batch?")]
    # The first may reuse the few template tokens an earlier test's chat began with (the server is the module's).
    first, second = (u.prompt_tokens_details.cached_tokens for u in usages)
    assert first < 8
    assert first + 40 < second < usages[1].prompt_tokens


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == ["gemma4-tiny"]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["resident_models"] == ["gemma4-tiny"]
    assert {"waiting_for_memory", "oldest_wait_s", "batch_steps", "prefix_hits"} <= h["queue"].keys()
    assert {"jobs_kv_bytes", "prefix_cache_bytes", "models_bytes"} <= h["memory"].keys()


def test_greedy_over_http_equals_mlx_lm(client, fixtures_dir):
    path = fixtures_dir / "gemma4-tiny"
    for content in ["What is a cache?", "def trim(self, n):", "Numbers: 1 2 3"]:
        messages = [{"role": "user", "content": content}]
        expected, expected_text = reference.greedy(path, reference.chat_ids(path, messages), 24)
        r = client.chat.completions.create(model="gemma4-tiny", messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == expected_text
        assert r.usage.completion_tokens == len(expected)


def _post(server, path, content, headers=None):
    h = {"Content-Type": "application/json"} | server.headers | (headers or {})
    return httpx.post(server.url + path, content=content, headers=h, timeout=30)


# Greedy: a sampled first token may be EOS, and then there is no completion token to count.
GOOD = {"model": "gemma4-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b'{"messages": NaN}', 400, "not valid JSON"),
        ("/v1/chat/completions", json.dumps(GOOD | {"messages": "hi"}), 400, "messages must be"),
        ("/v1/chat/completions", json.dumps(GOOD | {"messages": []}), 400, "non-empty"),
        ("/v1/chat/completions", json.dumps(GOOD | {"model": "gpt-17"}), 404, "not served here"),
        ("/v1/chat/completions", json.dumps(GOOD | {"max_tokens": -5}), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps(GOOD | {"max_tokens": 10**9}), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps(GOOD | {"temperature": "warm"}), 400, "temperature"),
        ("/v1/completions", json.dumps({"model": "gemma4-tiny", "prompt": "word " * 3000}), 400,
         "context of 1024"),
        ("/v1/completions", json.dumps({"prompt": "x" * (21 * 2**20)}), 413, "exceeds"),
        ("/v1/completions", json.dumps({"prompt": 12}), 400, "prompt must be"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_the_node_keeps_serving(server, path, body, status, fragment):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"]
    ok = _post(server, "/v1/chat/completions", json.dumps(GOOD))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_auth_is_required(server):
    r = _post(server, "/v1/chat/completions", json.dumps(GOOD), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_token_file_is_private(server):
    path = server.home / "state" / "provider" / "local-api-token"
    assert path.stat().st_mode & 0o777 == 0o600


def test_client_disconnect_cancels_the_job(server):
    # Greedy, so the job cannot end on its own (a sampled EOS) before the client leaves.
    body = json.dumps(GOOD | {"max_tokens": 1000, "stream": True, "temperature": 0})
    with httpx.stream("POST", server.url + "/v1/chat/completions", content=body, headers=server.headers) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leave mid-stream
    until_blocking(lambda: httpx.get(server.url + "/health").json()["active_jobs"] == 0, "the job outlived its client")
    assert '"finish_reason": "cancelled"' in server.logs()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_streams_sse(server):
    out = subprocess.run(["curl", "-sN", server.url + "/v1/chat/completions", "-H",
                          f"Authorization: Bearer {server.token}", "-d", json.dumps(GOOD | {"stream": True})],
                         capture_output=True, text=True, timeout=60).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "telemetry" in json.loads(events[-2])


def test_logs_never_contain_prompt_or_completion_text(server, client):
    r = client.chat.completions.create(model="gemma4-tiny", messages=[{"role": "user", "content": MARKER * 3}],
                                       max_tokens=16, temperature=0)
    completion = r.choices[0].message.content
    logs = server.logs()
    assert "job_finished" in logs and MARKER not in logs
    assert len(completion) < 6 or completion not in logs
    for line in logs.splitlines():
        json.loads(line)  # JSON lines when not on a TTY


def test_ctrl_c_says_what_it_drains_and_a_second_one_cuts_it_now(fixtures_dir, tmp_path):
    """The first Ctrl-C names the jobs in flight and the grace they get (here 600 s); the second cuts them at once:
    the node exits long before the grace, each stream ended as it stands ("length", telemetry "cancelled")."""
    (tmp_path / "config" / "provider").mkdir(parents=True)
    (tmp_path / "config" / "provider" / "config.toml").write_text("shutdown_grace_s = 600\n")
    srv = LocalServer(fixtures_dir / "qwen3-tiny", tmp_path, "--no-auth")
    ends, streaming = [], threading.Semaphore(0)

    def long_request():
        body = {"model": "qwen3-tiny", "prompt": "x", "max_tokens": 5000, "stream": True, "temperature": 0}
        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        streaming.release()
        ends.append(json.loads(lines[-2][6:]))

    threads = [threading.Thread(target=long_request) for _ in range(4)]  # four rows: each decodes slower
    for t in threads:
        t.start()
    for _ in threads:
        assert streaming.acquire(timeout=120), "a request never started streaming"
    srv.proc.send_signal(signal.SIGINT)
    until_blocking(lambda: "in flight get up to 600 s to finish; Ctrl-C again to cut them now" in srv.logs(),
                   lambda: srv.logs()[-2000:], timeout=30)
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(60) == 0  # not the 600 s of grace
    for t in threads:
        t.join(60)
    assert "provider: cutting the jobs in flight now" in srv.logs()
    assert len(ends) == 4 and all(e["choices"][0]["finish_reason"] in ("length", "stop") for e in ends), ends
    assert any(e["telemetry"]["finish_reason"] == "cancelled" for e in ends), ends


def test_sigterm_stops_cleanly_with_a_request_in_flight(fixtures_dir, tmp_path):
    srv = LocalServer(fixtures_dir / "qwen3-tiny", tmp_path, "--no-auth")
    lines, streaming = [], threading.Event()

    def long_request():
        # Greedy, so that it cannot end on its own (a sampled EOS) before the SIGTERM.
        body = {"model": "qwen3-tiny", "prompt": "x", "max_tokens": 5000, "stream": True, "temperature": 0}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    streaming.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert streaming.wait(120), "the request never started streaming"
    # The bounds only catch a hang: the daemon drains for up to its 10 s grace, then cancels and exits.
    assert srv.stop(signal.SIGTERM, timeout=60) == 0
    t.join(60)
    assert not t.is_alive()
    # The in-flight stream was ended properly: a finishing chunk, then [DONE].
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    # A drain that ran out cuts the answer as it stands: "length" to the client (a reason every OpenAI client
    # knows), "cancelled" in its telemetry.
    assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
    if last["telemetry"]["finish_reason"] == "cancelled":
        assert last["choices"][0]["finish_reason"] == "length"
