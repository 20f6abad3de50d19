"""Every tool format mlx-lm ships, through the real local API and the openai SDK: a tiny model per format (one
shared random weight set; each tokenizer's special tokens are its format's markers and each template writes its
calls, so mlx-lm infers that parser), all served by one node.

What each test proves, honestly: a random model never chooses to call, so
- `required` and named calls are the format's grammar at work from the first token;
- `auto` with a call starts it with a logit bias on the format's opening marker (one special token): from that
  token on, the call is held to the grammar lazily (free until then) and read back by mlx-lm's parser. Formats
  whose marker is text (minicpm5) or several tokens (kimi_k3) cannot be biased into a call; their lazy trigger
  is tested on the row grammar (tests/test_constrained_engine.py);
- `auto` without a call shows free generation with tools offered is served (no 400) in every format.
Every call comes back in OpenAI's shape with arguments that validate against the tool's schema."""

import asyncio
import dataclasses
import json
import threading

import jsonschema
import openai
import pytest

from tools.fixtures.tool_formats import TOOL_FORMATS, make_tool_format
from tests.helpers import make_node

FORMATS = [*TOOL_FORMATS, "gemma4"]
TEXT_MARKER = {"minicpm5", "kimi_k3"}  # opening markers a logit bias on one token cannot start
START = {"json_tools": "<tool_call>", "qwen3_coder": "<tool_call>", "glm47": "<tool_call>", "laguna": "<tool_call>",
         "pythonic": "<|tool_call_start|>", "kimi_k2": "<|tool_calls_section_begin|>", "mistral": "[TOOL_CALLS]",
         "minimax_m2": "<minimax:tool_call>", "function_gemma": "<start_function_call>",
         "longcat": "<longcat_tool_call>", "muse_spark": "<atem:function_calls>", "gemma4": "<|tool_call>"}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


def weather(fmt: str) -> dict:
    # gemma4's grammar holds no numeric bounds: an enum bounds its integer
    days = {"type": "integer", "enum": [1, 2, 3]} if fmt == "gemma4" else {"type": "integer", "minimum": 1, "maximum": 7}
    return {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "maxLength": 8}, "days": days,
                                                 "units": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"}},
                                                 "required": ["city", "days"]}}}


NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One node serving every format's fixture behind the real local API, on its own event loop."""
    from provider.local.server import start_local_api

    root = tmp_path_factory.mktemp("formats")
    for fmt in FORMATS:
        make_tool_format(root / fmt, fmt, root / FORMATS[0])
    node = make_node({fmt: root / fmt for fmt in FORMATS}, max_concurrent_jobs=4, speculation="off",
                     max_resident_models=len(FORMATS))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, url = asyncio.run_coroutine_threadsafe(start_local_api(node, "127.0.0.1", 0, None), loop).result(60)
    specials = {fmt: json.loads((root / fmt / "tokenizer.json").read_text())["added_tokens"] for fmt in FORMATS}
    ids = {fmt: {t["content"]: t["id"] for t in specials[fmt]} for fmt in FORMATS}
    yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), ids
    asyncio.run_coroutine_threadsafe(node.stop(grace_s=0), loop).result(60)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module", params=FORMATS)
def fmt(request):
    """The format under test; module-scoped, so pytest runs each format's tests together."""
    return request.param


def _accumulate(deltas):
    calls = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
        c["name"] += d.function.name or ""
        c["arguments"] += d.function.arguments or ""
    return [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for c in calls.values()]


def _ask(client, stream: bool, **kw):
    """(finish_reason, tool calls, content) of one request, streamed or not."""
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return r.choices[0].finish_reason, m.tool_calls or [], m.content, r
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    if deltas:
        assert deltas[0].id and deltas[0].function.name  # the first delta of a call has its id and name
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(finish) == 1
    return finish[0], _accumulate(deltas), content or None, None


def _valid(calls, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in schemas
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def test_auto_without_a_call_and_none_are_served_in_every_format(served, fmt):
    """Offering tools never refuses a request: `auto` generates freely (the calls it may make are parsed by
    the format's own parser) and `none` shows the tools to the template as `auto` does, never calling."""
    client, _ = served
    tools = [weather(fmt), NOOP]
    finish, calls, content, auto = _ask(client, False, model=fmt, messages=ASK, tools=tools, max_tokens=12,
                                        temperature=0)
    assert finish in ("stop", "length", "tool_calls")
    if calls:
        _valid(calls, tools)
    finish, calls, _, none = _ask(client, False, model=fmt, messages=ASK, tools=tools, tool_choice="none",
                                  max_tokens=12, temperature=0)
    assert not calls and finish in ("stop", "length")
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens  # the tools are in both prompts


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_a_call_is_held_to_the_format_once_begun_and_parsed(served, fmt, stream):
    if fmt in TEXT_MARKER:
        pytest.skip("its opening marker is not one token: tested on the row grammar (test_constrained_engine)")
    client, ids = served
    tools = [weather(fmt), NOOP]
    finish, calls, content, _ = _ask(client, stream, model=fmt, messages=ASK, tools=tools, max_tokens=300,
                                     temperature=0, parallel_tool_calls=False,
                                     logit_bias={str(ids[fmt][START[fmt]]): 100})
    assert finish == "tool_calls", (finish, content)
    _valid(calls, tools)
    assert len(calls) == 1 and not (content or "").strip()


@pytest.mark.parametrize("choice, stream", [("required", False), ("named", True), ("required", True),
                                           ("named", False)])
def test_required_and_named_calls_are_forced_in_every_format(served, fmt, choice, stream):
    client, _ = served
    tools = [weather(fmt), NOOP]
    if choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
    finish, calls, content, _ = _ask(client, stream, model=fmt, messages=ASK, tools=tools, tool_choice=choice,
                                     max_tokens=300, temperature=0.7, seed=3, parallel_tool_calls=False)
    assert finish == "tool_calls", (choice, finish, content)
    _valid(calls, tools)
    assert content is None or not content.strip()
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]


def test_the_call_and_its_result_go_back_into_the_template(served, fmt):
    client, _ = served
    tools = [weather(fmt)]
    r = client.chat.completions.create(model=fmt, messages=ASK, tools=tools, tool_choice="required", temperature=0,
                                       max_tokens=300, parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    after = client.chat.completions.create(model=fmt, messages=history, tools=tools, max_tokens=8, temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call, in the format, and the result are in the prompt: more tokens than the question and the call
    assert after.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("fmt_name, tool", [
    ("function_gemma", {"name": "f", "parameters": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}}}}}),
    ("qwen3_coder", {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}),
    ("glm47", {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^a+$"}}}}),
])
def test_a_schema_a_format_cannot_write_is_refused_naming_tools_and_auto_still_serves(served, fmt_name, tool):
    client, _ = served
    fmt = fmt_name
    tools = [{"type": "function", "function": tool}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=fmt, messages=ASK, tools=tools, tool_choice="required", max_tokens=8)
    assert e.value.body["param"] == "tools", e.value.body
    r = client.chat.completions.create(model=fmt, messages=ASK, tools=tools, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_special_tokens_pass_where_the_text_is_free(served):
    """A model's own special tokens (a thinking channel's, say) are not masked under `auto` before a call:
    biased toward `<|im_start|>`, the model writes it."""
    client, ids = served
    r = client.chat.completions.create(model="json_tools", messages=ASK, tools=[weather("json_tools")],
                                       max_tokens=4, temperature=0, logit_bias={str(ids["json_tools"]["<|im_start|>"]): 100})
    assert r.choices[0].message.content == "<|im_start|>" * 4, r.choices[0].message.content


@pytest.mark.parametrize("fmt", [*FORMATS, "mistral-v3"])
def test_random_walks_through_each_forced_grammar_parse_into_valid_calls(tmp_path, fmt):
    """No model: any path through a format's forced grammar (parallel calls, optional arguments left out or
    not, any string the grammar allows), read back by mlx-lm's parser for that format, is whole calls that
    validate. Seeded walks, taking a random allowed token and ending where the grammar may."""
    import random

    import llguidance.numpy as lln
    import numpy as np
    from mlx_lm.utils import load_tokenizer

    from provider.constraints import OutputRules, Tool, ToolChoice
    from provider.engine.grammar_compile import Compiler, lark_for
    from provider.engine.tool_calls import ToolCallSplitter
    from provider.models.tool_format import tool_format_for

    base = fmt.removesuffix("-v3")
    make_tool_format(tmp_path / base, base)
    tok = load_tokenizer(tmp_path / base)
    tool_format, compiler = tool_format_for(tok), Compiler(tok, 512)
    if fmt == "mistral-v3":  # a tokenizer without [ARGS] (Mistral's v3): calls as a JSON list
        tool_format = dataclasses.replace(tool_format, special_ids={
            k: v for k, v in tool_format.special_ids.items() if k != "[ARGS]"})
    tools = [weather(base), NOOP]
    rules = OutputRules(tools=tuple(Tool(t["function"]["name"], t["function"]["parameters"]) for t in tools),
                        tool_choice=ToolChoice("required"))
    lark, ends = lark_for(rules, tool_format), set(tok.eos_token_ids)
    for seed in range(5):
        rng, m, ids = random.Random(seed), compiler.matcher(lark, "tools"), []
        bits = lln.allocate_token_bitmask(1, 512)
        while True:
            lln.fill_next_token_bitmask(m, bits, 0)
            allowed = np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:512])
            more = [int(t) for t in allowed if t not in ends]
            if not more or (len(more) < len(allowed) and rng.random() < 0.3):
                break
            token = rng.choice(more)
            assert m.consume_token(token) and len(ids) < 3000
            ids.append(token)
        splitter = ToolCallSplitter(tool_format, tools)
        content, calls = splitter.feed(tok.decode(ids))
        rest, more_calls = splitter.finish()
        assert not (content + rest).strip(), (seed, tok.decode(ids))
        _valid([openai.types.chat.ChatCompletionMessageToolCall(
            id=c.id, type="function", function={"name": c.name, "arguments": c.arguments})
            for c in (*calls, *more_calls)], tools)
