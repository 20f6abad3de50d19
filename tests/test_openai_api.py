"""Request parsing is pure: every bad field is a RequestError naming the parameter."""

import pytest

from provider.local.openai_api import Limits, RequestError, parse_chat, parse_completion

LIMITS = Limits(max_tokens_limit=4096, default_max_tokens=128)
MSG = [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_fields():
    r = parse_chat({"model": "m", "messages": MSG, "temperature": 0, "stop": "x", "seed": 3, "stream": True,
                    "stream_options": {"include_usage": True}, "speculation": "off"}, "j", LIMITS)
    assert r.stream and r.include_usage
    assert r.job.sampling.max_tokens == 128 and r.job.sampling.greedy and r.job.sampling.stop == ("x",)
    assert r.job.speculation == "off" and r.job.messages == ({"role": "user", "content": "hi"},)


def test_text_content_parts_are_joined():
    r = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]}, "j", LIMITS)
    assert r.job.messages[0]["content"] == "ab"


@pytest.mark.parametrize(
    "body, param",
    [
        ([], None),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content"),
        ({"messages": MSG, "max_tokens": -1}, "max_tokens"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "max_tokens": 10**12}, "max_tokens"),
        ({"messages": MSG, "max_tokens": "10"}, "max_tokens"),
        ({"messages": MSG, "max_tokens": True}, "max_tokens"),
        ({"messages": MSG, "temperature": "hot"}, "temperature"),
        ({"messages": MSG, "temperature": 3}, "temperature"),
        ({"messages": MSG, "top_p": 0}, "top_p"),
        ({"messages": MSG, "top_k": -2}, "top_k"),
        ({"messages": MSG, "stop": [1, 2]}, "stop"),
        ({"messages": MSG, "stop": ["a"] * 17}, "stop"),
        ({"messages": MSG, "seed": 1.5}, "seed"),
        ({"messages": MSG, "n": 17}, "n"),
        ({"messages": MSG, "n": True}, "n"),
        ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": MSG, "logprobs": 3}, "logprobs"),
        ({"messages": MSG, "stream": "yes"}, "stream"),
        ({"messages": MSG, "model": 7}, "model"),
        ({"messages": MSG, "speculation": "maybe"}, "speculation"),
        ({"messages": MSG, "stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_chat_fields(body, param):
    with pytest.raises(RequestError) as e:
        parse_chat(body, "j", LIMITS)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [None, "", 5, [], [[]], ["a", ""], ["a", 5], [[1, "a"]], [True],
                                    [-1], [[0, -3]], ["x"] * 65, {"a": 1}])
def test_bad_prompts(prompt):
    with pytest.raises(RequestError) as e:
        parse_completion({"prompt": prompt}, "j", LIMITS)
    assert e.value.param == "prompt"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": ["a"] * 8, "n": 9}, "n"),
])
def test_bad_completion_fields(body, param):
    with pytest.raises(RequestError) as e:
        parse_completion(body, "j", LIMITS)
    assert e.value.status == 400 and e.value.param == param


def test_prompt_forms_and_n_give_a_job_per_choice():
    assert parse_completion({"prompt": ["abc"]}, "j", LIMITS).job.prompt == "abc"
    r = parse_completion({"prompt": [[1, 2], [3]], "n": 2, "seed": 9, "echo": True, "logprobs": 1}, "j", LIMITS)
    assert [j.id for j in r.jobs] == ["j-0", "j-1", "j-2", "j-3"]
    assert [j.prompt_ids for j in r.jobs] == [(1, 2), (1, 2), (3,), (3,)]
    assert [j.sampling.seed for j in r.jobs] == [9, 10, 9, 10]  # seed + the choice's index within its prompt
    assert [j.share_prompt for j in r.jobs] == [True, False, True, False]
    assert [j.sampling.prompt_logprobs for j in r.jobs] == [True, False, True, False]  # scored once per prompt
    assert r.echo and r.logprobs and all(j.sampling.logprobs == 1 for j in r.jobs)
    single = parse_completion({"prompt": [5, 6, 7], "max_tokens": 0, "echo": True}, "j", LIMITS)
    assert single.job.id == "j" and single.job.prompt_ids == (5, 6, 7) and single.job.sampling.prompt_logprobs
    chat = parse_chat({"messages": MSG, "logprobs": True, "top_logprobs": 4, "n": 3}, "c", LIMITS)
    assert len(chat.jobs) == 3 and chat.job.sampling.logprobs == 4 and not chat.job.sampling.prompt_logprobs


def test_logits_processor_fields_are_parsed():
    r = parse_chat({"messages": MSG, "logit_bias": {"5": 10, "7": -3.5}, "presence_penalty": 0.5,
                    "frequency_penalty": -0.5, "repetition_penalty": 1.1}, "j", LIMITS)
    s = r.job.sampling
    assert s.logit_bias == ((5, 10.0), (7, -3.5)) and s.presence_penalty == 0.5 and s.repetition_penalty == 1.1
    assert s.has_logits_processors


@pytest.mark.parametrize("body, param", [
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "frobnicate": 1}}}]}, "tools"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "contains": {}}}}}, "response_format"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"x-guidance": {"lenient": True}}}}}}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls"),
    ({"messages": MSG, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": MSG, "presence_penalty": 5}, "presence_penalty"),
    ({"messages": MSG, "repetition_penalty": "high"}, "repetition_penalty"),
])
def test_unsupported_or_bad_fields_are_refused_not_ignored(body, param):
    with pytest.raises(RequestError) as e:
        parse_chat(body, "j", LIMITS)
    assert e.value.param == param
