"""OpenAI's Responses API through `provider start --local`, as the official openai SDK uses it: responses.create
plain and streamed, function tools and the function_call_output round trip, previous_response_id over the
store (GET, DELETE), text.format json_schema parsed by responses.parse, what Codex sends beyond the documented
fields, and errors in OpenAI's shape. Chat Completions' `developer` role beside them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import LocalServer

MODEL = "gemma4-demo"
WEATHER = {"type": "function", "name": "get_weather", "description": "The forecast for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"]}}
ASK = "What is the weather in Paris for two days?"


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_f32):
    """`provider start --local` on the bundled pair in float32 (conftest's demo_f32), named with --model and
    --drafter (so without the chat variant the default adds beside it)."""
    srv = LocalServer(demo_f32[0], tmp_path_factory.mktemp("node"), "--drafter", str(demo_f32[1]))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.token, max_retries=0)


def test_create_answers_with_output_text_and_usage(client):
    r = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.output_text
    assert (r.status == "incomplete") == (r.incomplete_details is not None)
    assert r.usage.input_tokens > 5 and r.usage.output_tokens >= 1
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.model_extra["telemetry"]["ttft_ms"] is not None


def test_a_stream_sends_typed_events_in_order_and_the_same_text(client):
    kw = dict(model=MODEL, input="Hi", max_output_tokens=16, temperature=0)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == client.responses.create(**kw).output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_function_call_and_its_output_round_trip(client, stream):
    kw = dict(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=120,
              temperature=0, parallel_tool_calls=False)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        assert "response.function_call_arguments.delta" in [e.type for e in events]
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])

    def followed(result: str):
        items = [{"role": "user", "content": ASK},
                 {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                  "arguments": calls[0].arguments},
                 {"type": "function_call_output", "call_id": calls[0].call_id, "output": result}]
        return client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=4, temperature=0)

    short, long = followed("Sunny"), followed("Sunny, then rain over the whole weekend and into Monday")
    assert long.usage.input_tokens > short.usage.input_tokens  # the output is in the prompt


@pytest.fixture(scope="module")
def llama(fixtures_dir, tmp_path_factory):
    """A model whose cached KV can be cut back to a shared prefix (no sliding-window layers): a hit does not
    hang on the answer re-tokenizing as it was generated."""
    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path_factory.mktemp("llama"))
    yield srv
    assert srv.stop() == 0


def test_previous_response_id_continues_from_the_store_and_reads_the_prefix_cache(llama):
    client = openai.OpenAI(base_url=llama.url + "/v1", api_key=llama.token, max_retries=0)
    kw = dict(model="llama-tiny", max_output_tokens=8, temperature=0)
    first = client.responses.create(input="Tell me about caches", **kw)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **kw)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="x", previous_response_id=first.id, **kw)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(input="x", store=False, **kw)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema_is_parsed_by_responses_parse(client):
    for t in (0.0, 1.0):
        r = client.responses.parse(model=MODEL, input="Make up a person.", text_format=Person, temperature=t,
                                   max_output_tokens=120)
        assert isinstance(r.output_parsed, Person), r.output_text
        assert r.model_extra["telemetry"]["constraint"] == "json_schema"
    r = client.responses.create(model=MODEL, input="JSON!", text={"format": {"type": "json_object"}},
                                max_output_tokens=200, temperature=0)
    assert r.output_text.startswith("{")


def test_what_codex_sends_is_accepted_and_what_is_left_out_is_said(llama):
    # On llama-tiny (context 1024): the max_output_tokens clamped to the context is decoded in seconds there, where
    # the bundled model's 32,768 would take an hour on a CPU.
    client = openai.OpenAI(base_url=llama.url + "/v1", api_key=llama.token, max_retries=0)
    namespace = {"type": "namespace", "name": "mcp_files", "description": "file tools",
                 "tools": [{"type": "function", "name": "read_file", "description": "Read",
                            "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                           "required": ["path"], "additionalProperties": False}}]}
    input_ = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files"}]},
              {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"}]
    r = client.responses.create(
        model="llama-tiny", input=input_, tools=[WEATHER, {"type": "web_search"}, namespace], tool_choice="auto",
        parallel_tool_calls=False, reasoning={"effort": "medium", "summary": "auto"},
        include=["reasoning.encrypted_content"], store=False, max_output_tokens=100000, temperature=0,
        extra_body={"prompt_cache_key": "k", "client_metadata": {"a": "b"}})
    left = " | ".join(r.model_extra["telemetry"]["left_out"])
    for what in ("field reasoning", "field include", "field prompt_cache_key", "field client_metadata",
                 "hosted tool web_search", "reasoning items"):
        assert what in left, left
    assert sorted(t.name for t in r.tools) == ["get_weather", "read_file"]  # the namespace's function offered
    assert r.model_extra["telemetry"]["max_tokens"]["clamped_by"] == "context"
    assert '"api": "openai_responses"' in llama.logs() and '"tools": 2' in llama.logs()


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
])
def test_errors_come_in_openais_shape(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL} | body, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_chat_completions_takes_the_developer_role_as_system(server, client):
    def messages(role: str) -> list[dict]:
        return [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}]

    def ids(role: str) -> list[int]:
        r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages(role)},
                       headers=server.headers, timeout=60)
        return r.json()["tokens"]

    assert ids("developer") == ids("system")  # rendered as the template renders system instructions
    r = client.chat.completions.create(model=MODEL, max_tokens=1, messages=messages("developer"))
    assert r.usage.prompt_tokens == len(ids("system"))


# --- the store's bounds (pure) ---------------------------------------------------------------------


def test_the_store_keeps_at_most_its_count_and_bytes_oldest_dropped_first():
    from provider.local.responses_store import ResponseStore

    store = ResponseStore(max_responses=3, max_bytes=10_000, max_age_s=60)
    for i in range(5):
        assert store.put(f"r{i}", [{"t": "x" * 10}], {"id": f"r{i}"})
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.put("big", [{"t": "x" * 6000}], {"id": "big"})  # past the bytes: the oldest go until it fits
    count, size = store.stats()
    assert size <= 10_000 and store.get("big") is not None and store.get("r2") is None and count <= 3
    assert not store.put("huge", [{"t": "x" * 20_000}], {}) and store.get("huge") is None  # alone too large
    assert store.delete("big") and not store.delete("big") and store.get("big") is None


def test_the_store_forgets_responses_past_their_age():
    from provider.local.responses_store import ResponseStore

    now = [0.0]
    store = ResponseStore(max_responses=10, max_bytes=10_000, max_age_s=60, clock=lambda: now[0])
    store.put("old", [], {})
    now[0] = 30.0
    store.put("young", [], {})
    now[0] = 61.0
    assert store.get("old") is None and store.get("young") is not None
    assert store.stats()[0] == 1
