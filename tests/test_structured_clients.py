"""Structured output and tool calls through `provider start --local`, as real clients use them: the openai SDK
(`parse`, json_object, tool choices streamed and not, the tool-result round trip), instructor, langchain-openai
and pydantic-ai; on the bundled model (the generic tool format) and on a fixture whose template writes Gemma 4's
own tool calls."""

import json
from typing import Literal, Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import LocalServer

T = [0.0, 0.7, 1.0]


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip: Optional[str] = Field(default=None, max_length=8)


class Person(BaseModel):  # nested objects, bounded numbers, an optional field
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    address: Address


class Order(BaseModel):  # enums, a list with maxItems, a bounded float
    status: Literal["open", "paid", "shipped"]
    items: list[Literal["tea", "cake", "soup"]] = Field(max_length=3)
    total: float = Field(ge=0, le=1000, multiple_of=0.01)  # money: bounded digits
    note: Optional[str] = Field(default=None, max_length=20)


class Flags(BaseModel):  # booleans and a short list of bounded strings
    urgent: bool
    tags: list[str] = Field(default_factory=list, max_length=2)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


@pytest.fixture(scope="module")
def bundled(tmp_path_factory, demo_f32):
    """`provider start --local` on the bundled pair in float32 (conftest's demo_f32: the same text, written several
    times faster), named with --model and --drafter (so without the chat variant the default adds beside it)."""
    target, assistant = demo_f32
    srv = LocalServer(target, tmp_path_factory.mktemp("node"), "--drafter", str(assistant))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(bundled):
    return openai.OpenAI(base_url=bundled.url + "/v1", api_key=bundled.token, max_retries=0)


def _validate_calls(calls, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


@pytest.mark.parametrize("schema", [Person, Order, Flags])
def test_parse_always_gives_the_schema_at_every_temperature(client, schema):
    for t in T:
        r = client.beta.chat.completions.parse(
            model="gemma4-demo", messages=[{"role": "user", "content": f"Make up a {schema.__name__} as JSON."}],
            response_format=schema, temperature=t, max_tokens=300, seed=7)
        m = r.choices[0].message
        assert isinstance(m.parsed, schema) and m.refusal is None, (t, m.content)
        assert r.model_extra["telemetry"]["constraint"] == "json_schema"


def test_json_object_is_always_json(client):
    for t in T:
        r = client.chat.completions.create(model="gemma4-demo", messages=[{"role": "user", "content": "JSON!"}],
                                           response_format={"type": "json_object"}, temperature=t, max_tokens=300,
                                           seed=3)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # an open object may run long on a tiny model: what came is still the start of one object
            assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_choices_always_call_with_valid_arguments(client, choice, stream):
    """One call (a named choice is one; `required` is asked for one: this tiny model, left free to add calls,
    adds them until max_tokens, see the next test)."""
    tools = [WEATHER, TIME]
    for t in T:
        kw = dict(model="gemma4-demo", messages=ASK, tools=tools, tool_choice=choice, temperature=t,
                  max_tokens=200, seed=11, parallel_tool_calls=False)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            first = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
            assert first and first[0].id and first[0].function.name  # the first delta has id and name
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            calls = _accumulate(first)
        else:
            r = client.chat.completions.create(**kw)
            finish, calls = [r.choices[0].finish_reason], r.choices[0].message.tool_calls
            assert r.choices[0].message.content is None
        assert finish == ["tool_calls"], (t, finish)
        _validate_calls(calls, tools)
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["get_time"]


def test_required_with_parallel_calls_gives_only_whole_valid_calls(client):
    for t in T:
        r = client.chat.completions.create(model="gemma4-demo", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=t, max_tokens=160, seed=4)
        m = r.choices[0].message
        _validate_calls(m.tool_calls, [WEATHER, TIME])  # a call cut short by max_tokens stays text
        assert r.choices[0].finish_reason in ("tool_calls", "length")


def _accumulate(deltas):
    """Stream deltas into whole calls, as the SDK's helpers do."""
    calls = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"id": d.id, "type": "function", "name": "", "arguments": ""})
        c["name"] += d.function.name or ""
        c["arguments"] += d.function.arguments or ""
    return [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for c in calls.values()]


def test_none_never_calls_and_auto_is_well_formed_either_way(client):
    for t in T:
        r = client.chat.completions.create(model="gemma4-demo", messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=t, max_tokens=60, seed=5)
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
        r = client.chat.completions.create(model="gemma4-demo", messages=ASK, tools=[WEATHER], temperature=t,
                                           max_tokens=200, seed=5)
        m = r.choices[0].message
        if m.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            _validate_calls(m.tool_calls, [WEATHER])
        else:
            assert "<tool_call>" not in (m.content or "")


def test_the_tool_result_round_trip_is_accepted(client):
    r = client.chat.completions.create(model="gemma4-demo", messages=ASK, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    after = client.chat.completions.create(model="gemma4-demo", messages=history, tools=[WEATHER], temperature=0,
                                           max_tokens=30)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.usage.prompt_tokens > r.usage.prompt_tokens


def test_instructor_tools_and_json_schema_modes(bundled):
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        ic = instructor.from_openai(openai.OpenAI(base_url=bundled.url + "/v1", api_key=bundled.token), mode=mode)
        person = ic.chat.completions.create(model="gemma4-demo", response_model=Person, max_retries=0,
                                            messages=[{"role": "user", "content": "A person, please."}],
                                            temperature=0.7, max_tokens=300)
        assert isinstance(person, Person)


def test_langchain_structured_output_and_bound_tools(bundled):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="gemma4-demo", base_url=bundled.url + "/v1", api_key=bundled.token, temperature=0,
                     max_tokens=300, max_retries=0)
    for method in ("json_schema", "function_calling"):
        assert isinstance(llm.with_structured_output(Order, method=method).invoke("An order, please."), Order)
    assert isinstance(llm.with_structured_output(None, method="json_mode").invoke("Some JSON."), dict)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])


def test_pydantic_ai_agent_output_type(bundled):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("gemma4-demo", provider=OpenAIProvider(base_url=bundled.url + "/v1",
                                                                   api_key=bundled.token))
    agent = Agent(model, output_type=Order, model_settings={"temperature": 0.7, "max_tokens": 300,
                                                            "parallel_tool_calls": False})
    assert isinstance(agent.run_sync("An order, please.").output, Order)


@pytest.fixture(scope="module")
def gemma4_native(fixtures_dir, tmp_path_factory):
    srv = LocalServer(fixtures_dir / "gemma4-tools", tmp_path_factory.mktemp("g4"), "--no-auth")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    assert srv.stop() == 0


G4_TOOL = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "units": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"},
    "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
    "where": {"type": "object", "properties": {"lat": {"type": "string", "maxLength": 5}}, "required": ["lat"]}},
    "required": ["city", "units"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_gemma4_native_calls_are_forced_in_its_own_format(gemma4_native, stream):
    """A random model: only the grammar makes these calls; they come back parsed by mlx-lm's gemma4 parser."""
    for t in T:
        for choice in ("required", {"type": "function", "function": {"name": "book"}}):
            kw = dict(model="gemma4-tools", messages=ASK, tools=[G4_TOOL, TIME], tool_choice=choice,
                      temperature=t, max_tokens=200, seed=2)
            if stream:
                deltas = [d for c in gemma4_native.chat.completions.create(stream=True, **kw) if c.choices
                          for d in (c.choices[0].delta.tool_calls or [])]
                calls = _accumulate(deltas)
            else:
                r = gemma4_native.chat.completions.create(**kw)
                assert r.choices[0].finish_reason == "tool_calls"
                calls = r.choices[0].message.tool_calls
            _validate_calls(calls, [G4_TOOL, TIME])
