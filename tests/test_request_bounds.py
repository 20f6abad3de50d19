"""Issue 56: every request's cost is bounded before work, in the units the work takes, through `provider start
--local` on the bundled model (context 32,768 tokens, its longest token 16 characters: at most 524,288 characters
of prompt; its template spends at least 2 tokens on a message). Each flood is refused with a 400 or 413 before the
work it asks for, while /health answers beside it; how fast it answers is measured by tools/scripts/fuzz_campaign.py
(--floods), not here. Each test fails on the code before issue 56's bounds (seen: a 200 after tokenizing or
templating, a 500, no store in the books)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from tests.helpers import LocalServer

MODEL = "gemma4-demo"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LocalServer(None, tmp_path_factory.mktemp("bounds"))
    yield srv
    assert srv.stop() == 0


def _post(srv: LocalServer, path: str, body, timeout: float = 300) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, timeout=timeout,
                      headers={**srv.headers, "Content-Type": "application/json"})


def _beside_health(srv: LocalServer, requests: list[tuple[str, object]]) -> list[httpx.Response]:
    """Send `requests` at once while /health is asked over and over beside them; every /health must answer 200
    (how soon is the campaign's to measure). Returns the requests' responses."""
    done, health = threading.Event(), []

    def poll():
        with httpx.Client(timeout=300) as c:
            while not done.is_set():
                health.append(c.get(srv.url + "/health").status_code)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with ThreadPoolExecutor(min(len(requests), 8)) as pool:
            out = list(pool.map(lambda r: _post(srv, *r), requests))
    finally:
        done.set()
        poller.join()
    assert health and set(health) == {200}, health
    return out


def _refused(r: httpx.Response, status: int, *fragments: str) -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    err = body["error"]
    message = err["message"]
    assert all(f in message for f in fragments), message
    return err


def _good(srv: LocalServer) -> None:
    r = _post(srv, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "temperature": 0,
                                            "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text


# --- characters before tokenizing, count_tokens and /tokenize included -------------------------------------------


def test_count_tokens_and_tokenize_refuse_a_prompt_past_the_context_before_tokenizing(server):
    text = "word " * 520_000  # 2.6 MB: tokenized whole before (5.6 s holding the tokenizer's lock)
    flood = [("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": text}]}),
             ("/tokenize", {"model": MODEL, "prompt": text}),
             ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": text}]})] * 2
    for r in _beside_health(server, flood):
        if "/tokenize" in str(r.request.url):
            err = _refused(r, 400, "524288 characters", "tokens can hold")
            assert err["code"] == "context_length_exceeded"
        else:
            assert _refused(r, 400, "tokens can hold")["type"] == "invalid_request_error"
    ok = _post(server, "/tokenize", {"model": MODEL, "prompt": "word " * 100})
    assert ok.status_code == 200 and ok.json()["count"] > 100
    _good(server)


# --- items and templated size before templating ------------------------------------------------------------------


def _empty_turns(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(n)]


def test_empty_messages_are_counted_before_templating(server):
    # 16,999 empty messages: 0 characters, 2 template tokens each at least, past the 32,768 of the context: refused
    # before the template renders them (before: templated, 5 tokens each, then refused on that count).
    few = _empty_turns(16_999)
    chat = ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": few})
    anthropic = ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [m | {"content": "x"} for m in few]})
    tokenize = ("/tokenize", {"model": MODEL, "messages": few})
    # 99,999 of them (3.4 MB): past the values one body may hold, refused before it is parsed (before: parsed,
    # built into a job and templated to 950,000 tokens, 7.1 s).
    huge = ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": _empty_turns(99_999)})
    got = _beside_health(server, [chat, anthropic, tokenize, huge])
    for r in got[:3]:
        _refused(r, 400, "16999 messages", "tokens can hold", "fewer messages")
    _refused(got[3], 413, "JSON values and keys", str(1 << 17))
    _good(server)


def test_a_coordinator_chat_of_65536_messages_is_refused_before_templating(tmp_path):
    """The coordinator session's jobs take the same prompt path: 65,536 empty messages (the wire's own cap on a
    chat's items) are refused on their count, not templated (before: 327,000 tokens templated, then refused)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    coord = ReferenceCoordinator(heartbeat_interval_ms=1000)
    call(coord.start())
    srv = LocalServer(None, tmp_path, "--coordinator", coord.url)
    try:
        session = call(coord.wait_for_node(60), 70)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user" if i % 2 == 0 else "assistant", content="")
                                         for i in range(1 << 16)])
        frame = pb.CoordinatorFrame(job_request=pb.JobRequest(job_id="many", model=MODEL, chat=chat, max_tokens=1))
        loop.call_soon_threadsafe(coord.send, session, frame)
        out = call(coord.outcome("many", 120), 130)
        assert out.WhichOneof("frame") == "job_error", out
        assert out.job_error.cause == pb.ERROR_CAUSE_CONTEXT_LENGTH_EXCEEDED, out.job_error
        assert "65536 messages" in out.job_error.message and "fewer messages" in out.job_error.message
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
    finally:
        assert srv.stop() == 0
        call(coord.kill())


# --- the tools' count before any is built ------------------------------------------------------------------------


def _ask(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}], **extra}


def test_tools_are_counted_before_any_is_built(server):
    tiny = [{"name": f"t{i}", "input_schema": {}} for i in range(150_000)]  # 9.5 s to build before, /health blocked
    flood = [("/v1/messages", _ask(tools=tiny)),
             ("/v1/messages", _ask(tools=tiny[:600])),  # before: all 600 built and checked, 472 left out, a 200
             ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 1,
                                "tools": [{"type": "namespace", "name": "ns", "tools": [
                                    {"type": "function", "name": f"f{i}", "parameters": {}} for i in range(600)]}]}),
             # Chat Completions refused more than 128 after building them all: the first one's fault was found first
             ("/v1/chat/completions", _ask(tools=[{"type": "function", "function": {"name": "bad name"}}]
                                           + [{"type": "function", "function": {"name": f"t{i}"}} for i in range(128)]))]
    got = _beside_health(server, flood)
    _refused(got[0], 413, "JSON values and keys")
    _refused(got[1], 400, "at most 512 entries", "got 600")
    _refused(got[2], 400, "at most 512 entries", "got 601")
    assert _refused(got[3], 400, "at most 128")["param"] == "tools"
    # within the count: the first 128 offered, the rest left out (none called: tool_choice none)
    offered = _post(server, "/v1/messages", _ask(tools=tiny[:200], tool_choice={"type": "none"}))
    assert offered.status_code == 200, offered.text
    assert "tools past the first 128" in offered.json()["telemetry"]["left_out"]


# --- a previous_response_id chain's total -------------------------------------------------------------------------


def test_a_previous_response_id_chain_is_bounded_as_one_request(server):
    """Left-out items (reasoning, unknown types) cost the prompt nothing but are kept and parsed again on every
    turn: a chain of them is bounded by what one request may hold, before the stored conversation is parsed
    (before: 12 chained 2 MB requests reached 1.2 M items)."""
    def turn(previous=None):
        body = {"model": MODEL, "max_output_tokens": 1, "temperature": 0,
                "input": [{"type": "reasoning", "summary": []}] * 10_000 + [{"role": "user", "content": "Hi"}]}
        return ("/v1/responses", body | ({"previous_response_id": previous} if previous else {}))

    first = _post(server, *turn())
    assert first.status_code == 200, first.text
    second = _post(server, *turn(first.json()["id"]))
    assert second.status_code == 200, second.text  # 2 x 60,000 values, within the 131,072 of one request
    third = _beside_health(server, [turn(second.json()["id"])] * 3)  # 3 x 60,000: past them
    for r in third:
        err = _refused(r, 413, "previous_response_id", "131072 values")
        assert err["code"] == "conversation_too_large"
    _good(server)


# --- the responses store, by what it holds, in /health, `provider status` and the books ----------------------------


def _memory(srv: LocalServer) -> dict:
    return httpx.get(srv.url + "/health", timeout=60).json()["memory"]


def test_the_responses_store_counts_what_it_holds_and_books_it(server):
    before = _memory(server)["responses_store_bytes"]
    junk = {f"k{i}": [0] * 8 for i in range(4000)}  # unknown keys: kept as sent, counted as kept
    body = {"model": MODEL, "max_output_tokens": 1, "temperature": 0,
            "input": [{"role": "user", "content": "Hi", "junk": junk}]}
    r = _post(server, "/v1/responses", body)
    assert r.status_code == 200, r.text
    sent = len(json.dumps(junk, separators=(",", ":")))
    mem = _memory(server)
    held = mem["responses_store_bytes"] - before
    assert sent < held < sent + 16_384, (sent, held)  # its items as compact JSON, the response beside them
    assert mem["reserved_bytes"] >= mem["models_bytes"] + mem["responses_store_bytes"]
    stored = httpx.get(f"{server.url}/v1/responses/{r.json()['id']}", headers=server.headers, timeout=60)
    assert stored.status_code == 200 and stored.json() == r.json()
    status = subprocess.run([sys.executable, "-m", "provider", "status"], env=server.env, capture_output=True,
                            text=True, timeout=60)
    assert "stored responses" in status.stdout, status.stdout + status.stderr
    assert httpx.delete(f"{server.url}/v1/responses/{r.json()['id']}", headers=server.headers).status_code == 200
    assert _memory(server)["responses_store_bytes"] == before


# --- deep nesting anywhere is a 400 --------------------------------------------------------------------------------


def _deep(n: int) -> bytes:
    return b"[" * n + b"1" + b"]" * n


def test_deep_nesting_anywhere_is_a_400(server):
    chat = json.dumps(_ask(temperature=0)).encode()
    responses = json.dumps({"model": MODEL, "input": "Hi", "max_output_tokens": 1, "metadata": {"m": 0}}).encode()
    # Before: a 500 where the parser's stack still reached but a walk of the value did not (RecursionError in
    # constraints.short; in the store's json.dumps, after the job ran): 966-969 levels here, ~980 elsewhere; deeper,
    # the parser's own 400. A sweep finds the window wherever the stack puts it.
    cases = [("/v1/chat/completions", chat.replace(b'"temperature": 0', b'"temperature": ' + _deep(d)))
             for d in range(940, 1000)]
    cases += [("/v1/responses", responses.replace(b'{"m": 0}', b'{"m": ' + _deep(d) + b"}")) for d in range(940, 1000)]
    cases += [("/v1/messages", chat.replace(b'"temperature": 0', b'"temperature": ' + _deep(100))),
              ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "extra": {"a": 1}}).encode()
               .replace(b'{"a": 1}', _deep(65)))]  # before: a 200, the field unread
    got = _beside_health(server, cases)
    assert not [r.status_code for r in got if r.status_code >= 500], [r.status_code for r in got]
    for r in got:
        _refused(r, 400, "nested too deeply", "at most 64")
    _good(server)


# --- found by a review outside the tests (issue 56) -------------------------------------------------------------

def test_tool_call_arguments_are_counted_before_templating(server):
    """An assistant turn's calls are templated into the prompt: 16 calls of 40 KiB arguments are 655,000
    characters, past the 524,288 the context can hold, refused on that count before the template renders them
    (before: uncounted, templated and tokenized to a million tokens, the tokenizer's lock held for 15 s)."""
    args = json.dumps({"a": "word " * 8000})
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": args}} for i in range(16)]
    chat = ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": f"call_{i}", "content": "ok"} for i in range(16))]})
    items = [{"type": "function_call", "call_id": f"call_{i}", "name": "f", "arguments": args} for i in range(16)]
    responses = ("/v1/responses", {"model": MODEL, "max_output_tokens": 16, "input": [
        {"role": "user", "content": "Hi"}, *items,
        *({"type": "function_call_output", "call_id": f"call_{i}", "output": "ok"} for i in range(16))]})
    uses = [{"type": "tool_use", "id": f"toolu_{i}", "name": "f", "input": json.loads(args)} for i in range(16)]
    anthropic = ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": uses},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "ok"}
                                     for i in range(16)]}]})
    for r in _beside_health(server, [chat, responses, anthropic]):
        _refused(r, 400, "characters", "tokens can hold")
    _good(server)


def test_an_integer_past_forty_digits_is_refused_as_it_is_parsed(server):
    """CPython makes an int of n digits in n^2 time inside json.loads, holding every thread: 4,877 integers of
    4,299 digits (under Python's own limit, and few values) held the event loop for 1.5 s. Now past 40 digits a
    body is not JSON the node takes (before: parsed, then refused or stored as whatever field held it)."""
    huge = int("9" * 4299)
    for path, body in (("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "seed": huge,
                                                 "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/tokenize", {"model": MODEL, "prompt": "Hi", "x": [huge] * 3})):
        _refused(_post(server, path, body), 400, "not valid JSON", "integers are at most 40 digits")
    ok = _post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "seed": (1 << 64) - 1,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    assert ok.status_code == 200, ok.text  # a 64-bit seed (20 digits) still is


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed_echo"])
def test_an_answers_logprobs_are_shaped_and_encoded_off_the_event_loop(fixtures_dir, monkeypatch, stream):
    """An outside review (issue 56): 64 echoed prompts with 20 logprobs each make a 25.8 MiB answer, which was
    shaped and encoded on the event loop the coordinator session shares (/health held 1.4-2.6 s; how long is the
    campaign's to measure). One ring out, a streamed echo's first chunk holds a whole prompt's logprobs. Through a
    real server in this process: every prompt's logprobs (and a whole answer's choices') are shaped on another
    thread than the loop's and encoded a piece at a time, and the answer holds them all."""
    from aiohttp import web

    from provider.local import completions, chat_output as out
    from provider.local.server import LocalAPI
    from tests.helpers import make_node

    on_loop: list[tuple[bool, int]] = []  # (on the loop, how many positions) of each shaping
    shape = out.completion_logprobs
    pieces: list[int] = []  # each json.dumps call's length: the answer is encoded a piece at a time
    monkeypatch.setattr(completions, "json", type("Spied", (), {"dumps": staticmethod(
        lambda v, **kw: pieces.append(len(json.dumps(v, **kw))) or json.dumps(v, **kw))}))

    def spied(lps, *args, **kw):
        on_loop.append((asyncio._get_running_loop() is not None, len(lps)))
        return shape(lps, *args, **kw)

    monkeypatch.setattr(out, "completion_logprobs", spied)
    node = make_node({"llama-tiny": fixtures_dir / "llama-tiny"})

    async def ask() -> httpx.Response:
        runner = web.AppRunner(LocalAPI(node, None).app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient(timeout=120) as c:
                return await c.post(f"http://127.0.0.1:{port}/v1/completions", json={
                    "model": "llama-tiny", "prompt": ["The quick brown fox", "jumps over"], "echo": True,
                    "logprobs": 5, "max_tokens": 2, "temperature": 0, "stream": stream})
        finally:
            await runner.cleanup()
            await node.stop()

    r = asyncio.run(ask())
    assert r.status_code == 200, r.text
    if not stream:
        answer = r.json()
        choices = answer["choices"]
        assert len(choices) == 2 and all(len(c["logprobs"]["top_logprobs"]) > 2 for c in choices), choices
        assert on_loop and not any(loop for loop, _ in on_loop), on_loop
        # and encoded a piece at a time (one json.dumps of all of it held the loop 1.6 s from another thread),
        # the same text json.dumps gives
        assert pieces and max(pieces) < len(r.text) / 10, (max(pieces), len(r.text))
        assert completions.dumps_in_pieces(answer) == json.dumps(answer) == r.text
        return
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    echoes = [c for c in chunks if c["choices"][0]["text"] in ("The quick brown fox", "jumps over")]
    assert len(echoes) == 2 and all(len(c["choices"][0]["logprobs"]["top_logprobs"]) > 1 for c in echoes), chunks
    # The echoes' shaping (a whole prompt's positions) ran off the loop; a token's own chunk (one position) may not
    prompts = [loop for loop, n in on_loop if n > 1]
    assert len(prompts) == 2 and not any(prompts), on_loop
    # and each echo encoded a piece at a time: no json.dumps call made a whole echo chunk's text
    echo_text = min(len(json.dumps(c, separators=(",", ":"))) for c in echoes)
    assert pieces and max(pieces) < echo_text, (pieces, echo_text)
