"""Tool calls out of streamed text, and the tool formats' prompts and grammars: pure, no model."""

import json

import pytest

from provider.constraints import ConstraintError, OutputRules, ResponseFormat, Tool, ToolChoice, closed
from provider.engine.tool_calls import ToolCallSplitter
from provider.models.gemma4_call_grammar import gemma4_arguments_grammar
from provider.models.tool_format import GENERIC, ToolFormat, _parse_json_call

GENERIC_FORMAT = ToolFormat(GENERIC, "<tool_call>", "</tool_call>", _parse_json_call, False, {})
TWO_CALLS = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>  \n')


def _split(text: str, step: int):
    sp = ToolCallSplitter(GENERIC_FORMAT, [])
    out = [sp.feed(text[i:i + step]) for i in range(0, len(text), step)] + [sp.finish()]
    return "".join(o[0] for o in out), [c for o in out for c in o[1]]


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 1000])
def test_calls_come_out_whole_however_the_text_is_cut(step):
    content, calls = _split(TWO_CALLS, step)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                   ("noop", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("text", ["plain text  with < and <tool but no call \n", "<tool_call>\n{bad json\n</tool_call> x",
                                  'cut short <tool_call>\n{"name"'])
def test_text_that_is_not_a_whole_call_stays_content_exactly(text, step):
    assert _split(text, step) == (text, [])


def test_objects_that_list_properties_are_closed_unless_they_say_otherwise():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "object", "additionalProperties": True}},
              "$defs": {"D": {"properties": {"e": {}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True and out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is untouched


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}, "minimum"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}, "pattern"),
    ({"type": "object", "properties": {"bad key": {"type": "string"}}}, "property names"),
    ({"type": "object", "properties": {"r": {"$ref": "#/$defs/Missing"}}}, "$ref"),
    ({"type": "object", "properties": {"a": {"type": "array", "maxItems": 10**6}}}, "maxItems"),
])
def test_the_gemma4_format_refuses_what_it_cannot_enforce(schema, fragment):
    with pytest.raises(ConstraintError) as e:
        gemma4_arguments_grammar("args_0", schema, "<[14]>")
    assert fragment in e.value.message and e.value.param == "tools"


def test_the_generic_format_puts_tools_in_a_preamble_and_history_in_plain_turns():
    rules = OutputRules(tools=(Tool("get_weather", {"type": "object", "properties": {}}, "Weather"),),
                        tool_choice=ToolChoice("auto"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"d": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "And?"}]
    out, tools = GENERIC_FORMAT.prompt_messages(messages, rules)
    assert tools is None and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[0]["content"].endswith("Be brief.")
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"d": 1}}'
                                                      '\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\nAnd?"}  # turns merged
    plain, _ = GENERIC_FORMAT.prompt_messages(messages[:2], OutputRules(ResponseFormat("json_object")))
    assert plain == messages[:2]  # no tools offered: the messages as they were


def test_a_format_without_a_call_grammar_refuses_forced_calls_naming_tool_choice_and_parses_auto():
    """A format with no grammar here (an unknown parser's name): `required` and named choices are a 400 naming
    tool_choice; `auto` compiles nothing (its calls are parsed after free generation)."""
    from provider.engine.grammar_compile import compile_rules

    fmt = ToolFormat("some_new_parser", "<call>", "</call>", _parse_json_call, True, {})
    tool = Tool("f", {"type": "object", "properties": {}})
    for choice in (ToolChoice("required"), ToolChoice("function", "f")):
        with pytest.raises(ConstraintError) as e:
            fmt.call_grammar(OutputRules(tools=(tool,), tool_choice=choice))
        assert e.value.param == "tool_choice" and "some_new_parser" in e.value.message
    assert compile_rules(None, OutputRules(tools=(tool,), tool_choice=ToolChoice("auto")), fmt) is None


def test_a_native_template_sees_the_tools_under_none_and_the_generic_preamble_does_not():
    tool = Tool("f", {"type": "object", "properties": {}})
    native = ToolFormat("json_tools", "<tool_call>", "</tool_call>", _parse_json_call, True, {})
    messages = [{"role": "user", "content": "hi"}]
    _, tools = native.prompt_messages(messages, OutputRules(tools=(tool,), tool_choice=ToolChoice("none")))
    assert tools == [tool.as_openai()]
    out, _ = GENERIC_FORMAT.prompt_messages(messages, OutputRules(tools=(tool,), tool_choice=ToolChoice("none")))
    assert out == messages
