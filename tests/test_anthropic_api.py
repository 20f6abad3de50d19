"""Anthropic's Messages API through `provider start --local`, as the official `anthropic` SDK uses it: create,
stream (text_stream, get_final_message), tools with auto / any / named choices and the tool-result round trip,
images (on the vision fixture), count_tokens, what agents send beyond the documented fields, and errors in
Anthropic's shape."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import jsonschema
import numpy as np
import pytest
from PIL import Image

from tools.fixtures.vision import make_gemma4_vlm
from tests.helpers import LocalServer

MODEL = "gemma4-demo"
GREEDY = {"temperature": 0}  # the SDK no longer names sampling fields; the API still takes them
WEATHER = {"name": "get_weather", "description": "The forecast for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"]}}
TIME = {"name": "get_time", "description": "The time in a zone",
        "input_schema": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
                         "required": ["zone"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_f32):
    """`provider start --local` on the bundled pair in float32 (conftest's demo_f32), named with --model and
    --drafter (so without the chat variant the default adds beside it)."""
    srv = LocalServer(demo_f32[0], tmp_path_factory.mktemp("node"), "--drafter", str(demo_f32[1]))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=server.token, max_retries=0)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_answers_a_message_with_usage_and_telemetry(client):
    m = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Hello there"}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 5 and _text(m)
    assert m.model_extra["telemetry"]["ttft_ms"] is not None


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    ask = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Tell me about caches"}],
               extra_body=GREEDY)
    full = _text(client.messages.create(**ask))
    words = [w for w in full.split() if len(w) > 2]
    stop = words[len(words) // 2]
    m = client.messages.create(stop_sequences=[stop, "never-said"], **ask)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert full.startswith(_text(m)) and stop not in _text(m)


def test_a_stream_gives_the_same_text_as_its_final_message(client):
    with client.messages.stream(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}],
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and _text(final) == text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    whole = client.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}],
                                   extra_body=GREEDY)
    assert _text(whole) == text  # one job path: the same greedy answer streamed or not


def test_the_stream_speaks_anthropics_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": server.token, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def _calls(message, tools):
    schemas = {t["name"]: t["input_schema"] for t in tools}
    calls = [b for b in message.content if b.type == "tool_use"]
    for c in calls:
        assert c.id.startswith("toolu_")
        jsonschema.validate(c.input, schemas[c.name])
    return calls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_forced_choices_call_a_tool_with_valid_input(client, choice, stream):
    tools = [WEATHER, TIME]
    kw = dict(model=MODEL, max_tokens=120, messages=ASK, tools=tools, extra_body=GREEDY,
              tool_choice=choice | {"disable_parallel_tool_use": True})
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use", m
    calls = _calls(m, tools)
    assert calls
    if choice["type"] == "tool":
        assert [c.name for c in calls] == ["get_time"]


def test_auto_may_answer_or_call_and_none_never_calls(client):
    m = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[WEATHER, TIME], extra_body=GREEDY)
    assert m.stop_reason in ("tool_use", "end_turn", "max_tokens")
    assert bool(_calls(m, [WEATHER, TIME])) == (m.stop_reason == "tool_use")
    m = client.messages.create(model=MODEL, max_tokens=20, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"},
                               extra_body=GREEDY)
    assert m.stop_reason != "tool_use" and m.model_extra["telemetry"].get("constraint") is None


def test_the_tool_result_round_trip_reaches_the_prompt(client):
    first = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    call = _calls(first, [WEATHER])[0]

    def turn(result):
        return ASK + [{"role": "assistant", "content": first.content},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result},
                                                   {"type": "text", "text": "Thanks. Summarise it."}]}]

    m = client.messages.create(model=MODEL, max_tokens=12, messages=turn("Sunny, 21 C"), tools=[WEATHER],
                               extra_body=GREEDY)
    assert m.usage.output_tokens >= 1
    short = client.messages.count_tokens(model=MODEL, messages=turn("Sunny"), tools=[WEATHER]).input_tokens
    long = client.messages.count_tokens(
        model=MODEL, messages=turn([{"type": "text", "text": "Sunny, then rain over the whole weekend"}]),
        tools=[WEATHER]).input_tokens
    assert long > short  # the result's text is in the prompt, as a string or as blocks


def test_count_tokens_is_what_the_message_reads(client):
    kw = dict(model=MODEL, system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
              messages=ASK, tools=[WEATHER, TIME])
    counted = client.messages.count_tokens(**kw).input_tokens
    m = client.messages.create(max_tokens=4, extra_body=GREEDY, **kw)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    without_tools = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert without_tools < counted


@pytest.fixture(scope="module")
def llama(fixtures_dir, tmp_path_factory):
    """A model without sliding-window layers, whose cached KV can be cut back to a shared prefix (the bundled
    Gemma's rotating caches cannot: there a hit needs the cached tokens, answer included, to prefix the new
    prompt exactly, which a re-tokenized answer may not)."""
    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path_factory.mktemp("llama"))
    yield srv
    assert srv.stop() == 0


def test_a_resent_prompt_is_read_from_the_prefix_cache(llama):
    client = anthropic.Anthropic(base_url=llama.url, api_key=llama.token, max_retries=0)
    kw = dict(model="llama-tiny", max_tokens=4, system="You are a careful assistant. " * 20, extra_body=GREEDY)
    first = client.messages.create(messages=[{"role": "user", "content": "First question"}], **kw)
    m = client.messages.create(messages=[{"role": "user", "content": "First question"},
                                         {"role": "assistant", "content": first.content},
                                         {"role": "user", "content": "Second one"}], **kw)
    # as agents resend it: the whole conversation so far; all of the first prompt is read from the cache
    assert first.usage.cache_read_input_tokens == 0
    assert m.usage.cache_read_input_tokens >= first.usage.input_tokens - 2, (first.usage, m.usage)


def test_what_agents_send_beyond_the_documented_fields_is_left_out_and_said(server, client):
    """Claude Code's extra fields, a hosted tool, a thinking block passed back, an unenforceable schema keyword
    and a max_tokens past the model's context: answered, each said in telemetry."""
    tools = [WEATHER | {"input_schema": WEATHER["input_schema"] | {"propertyNames": {"pattern": "^[a-z]+$"}}},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                                  {"type": "text", "text": "Hello."}]},
                {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]}]
    # A stop sequence ends the answer early: what is checked is the clamp, not thirty thousand tokens decoded. The
    # node's own limit (32768) passes; the bundled model's context (32768) less the prompt does not.
    m = client.messages.create(model=MODEL, max_tokens=32768, messages=messages, tools=tools, stop_sequences=[" "],
                               thinking={"type": "enabled", "budget_tokens": 1024}, metadata={"user_id": "u"},
                               extra_body={"context_management": {"edits": []}, "temperature": 0},
                               output_config={"effort": "low"}, extra_headers={"anthropic-beta": "x"}, timeout=120)
    t = m.model_extra["telemetry"]
    left = " | ".join(t["left_out"])
    for what in ("field thinking", "field context_management", "field output_config", "hosted tool web_search",
                 "thinking blocks", "propertyNames"):
        assert what in left, left
    assert t["max_tokens"]["asked"] == 32768 and t["max_tokens"]["clamped_by"] == "context"
    assert t["max_tokens"]["served"] == 32768 - m.usage.input_tokens - m.usage.cache_read_input_tokens
    assert '"api": "anthropic_messages"' in server.logs() and '"tools": 1' in server.logs()


def test_a_bearer_token_is_accepted_beside_x_api_key(server):
    c = anthropic.Anthropic(base_url=server.url, auth_token=server.token, api_key=None, max_retries=0)
    assert c.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).usage


@pytest.mark.parametrize("kw, error, fragment", [
    (dict(max_tokens=0), anthropic.BadRequestError, "max_tokens"),
    (dict(messages=[]), anthropic.BadRequestError, "messages"),
    (dict(messages=[{"role": "tool", "content": "x"}]), anthropic.BadRequestError, "role"),
    (dict(extra_body={"temperature": 7}), anthropic.BadRequestError, "temperature"),
    (dict(model="no-such-model"), anthropic.NotFoundError, "no-such-model"),
    (dict(tool_choice={"type": "sometimes"}), anthropic.BadRequestError, "tool_choice"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "http://169.254.169.254/"}}]}]), anthropic.BadRequestError, "does not fetch URLs"),
])
def test_errors_come_in_anthropics_shape(client, kw, error, fragment):
    ask = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]) | kw
    with pytest.raises(error) as e:
        client.messages.create(**ask)
    body = e.value.body
    assert body["type"] == "error" and fragment in body["error"]["message"], body
    assert body["error"]["type"] == ("not_found_error" if e.value.status_code == 404 else "invalid_request_error")


def test_a_wrong_key_is_an_authentication_error(server):
    c = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"


# --- images, on the vision fixture ----------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    make_gemma4_vlm(root / "gemma4-vlm")
    srv = LocalServer(root / "gemma4-vlm", root)
    yield srv
    assert srv.stop() == 0


def _png(seed: int) -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_an_image_block_is_seen(vlm):
    c = anthropic.Anthropic(base_url=vlm.url, api_key=vlm.token, max_retries=0)

    def ask(*blocks):
        return c.messages.create(model="gemma4-vlm", max_tokens=6, extra_body=GREEDY, messages=[
            {"role": "user", "content": [*blocks, {"type": "text", "text": "What is it?"}]}])

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(1)}}
    plain, seen = ask(), ask(image)
    assert seen.usage.input_tokens > plain.usage.input_tokens + 16  # the image's soft tokens
    counted = c.messages.count_tokens(model="gemma4-vlm", messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]).input_tokens
    assert counted == seen.usage.input_tokens + seen.usage.cache_read_input_tokens
    other = ask({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(2)}})
    assert _text(other) != _text(seen) or other.usage != seen.usage
    with pytest.raises(anthropic.BadRequestError) as e:
        ask({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@notbase64"}})
    assert "not valid base64" in e.value.body["error"]["message"]
