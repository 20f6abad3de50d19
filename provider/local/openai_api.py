"""OpenAI request bodies -> Job, and Events -> OpenAI response bodies. Pure: no I/O, no MLX."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ..constraints import OutputRules, ResponseFormat, Tool, ToolChoice
from ..jobs import MAX_STOP_STRINGS, Done, Job, JobError, SamplingParams, ToolCall, resolve_max_tokens
from ..types import Cause
from ..status import NodeStatus


class RequestError(ValueError):
    """A malformed request: an HTTP status and an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# How each job failure cause reaches an HTTP client.
CAUSE_STATUS: dict[Cause, tuple[int, str]] = {
    Cause.INVALID_REQUEST: (400, "invalid_request_error"),
    Cause.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    Cause.UNKNOWN_MODEL: (404, "invalid_request_error"),
    Cause.SPECULATION_UNAVAILABLE: (400, "invalid_request_error"),
    Cause.OVERLOADED: (429, "rate_limit_error"),
    Cause.INSUFFICIENT_MEMORY: (503, "server_error"),
    Cause.DRAINING: (503, "server_error"),
    Cause.MODEL_LOAD_FAILED: (500, "server_error"),
    Cause.COORDINATOR_LOST: (502, "server_error"),
    Cause.DEADLINE_EXCEEDED: (504, "server_error"),
    Cause.DUPLICATE_JOB: (409, "invalid_request_error"),
    Cause.WEIGHTS_MISMATCH: (500, "server_error"),
    Cause.SEALING_FAILED: (400, "invalid_request_error"),
    Cause.INTERNAL: (500, "server_error"),
}


def error_for(cause: Cause, message: str, param: str | None = None) -> RequestError:
    status, type_ = CAUSE_STATUS[cause]
    code = "model_not_found" if cause is Cause.UNKNOWN_MODEL else cause.value
    return RequestError(message, param, status=status, code=code, type_=type_)


@dataclass(frozen=True)
class Limits:
    max_tokens_limit: int
    default_max_tokens: int


@dataclass(frozen=True)
class ParsedRequest:
    job: Job
    stream: bool
    include_usage: bool


def parse_chat(body: Any, job_id: str, limits: Limits) -> ParsedRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty array of {role, content} objects", "messages")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    return _finish(body, job_id, limits, messages=parsed)


def parse_completion(body: Any, job_id: str, limits: Limits) -> ParsedRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string (batches of prompts are not supported)", "prompt")
    if not prompt:
        raise RequestError("prompt must not be empty", "prompt")
    return _finish(body, job_id, limits, prompt=prompt)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _message(m: Any, i: int) -> dict[str, Any]:
    """The wire shape of one message; its role and text are checked by `Job`."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{param} must be an object with role and content", param)
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is served here
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{param}.content[{j}] must be a text part; images and audio are not supported",
                                   f"{param}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and m.get("role") == "assistant":
        content = ""
    if not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string or an array of text parts", f"{param}.content")
    out = {"role": m.get("role"), "content": content}
    for key in ("tool_calls", "tool_call_id", "name"):  # checked by Job (constraints.check_message_tool_fields)
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _finish(body: dict[str, Any], job_id: str, limits: Limits, **prompt: Any) -> ParsedRequest:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise RequestError("logprobs are not supported", "logprobs")
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise RequestError(f"{key} is OpenAI's deprecated form; send tools and tool_choice", key)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    try:
        job = Job(id=job_id, model=model, sampling=_sampling(body, limits), rules=output_rules(body),
                  speculation=_given(body, "speculation", "auto"), **prompt)
    except JobError as e:  # the shared bounds (jobs.py, constraints.py), reported against the field at fault
        raise RequestError(e.message, e.param) from None
    return ParsedRequest(job, stream, _bool(options, "include_usage", False))


def output_rules(body: dict[str, Any]) -> OutputRules:
    """response_format, tools, tool_choice and parallel_tool_calls: wire shapes into OutputRules (which checks
    every value)."""
    tools = _given(body, "tools", [])
    if not isinstance(tools, list):
        raise RequestError("tools must be an array of {type: function, function: {...}}", "tools")
    parsed = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{name, parameters}}}}",
                               "tools")
        parsed.append(Tool(fn.get("name"), _given(fn, "parameters", {"type": "object", "properties": {}}),
                           _given(fn, "description", "")))
    choice = _given(body, "tool_choice", "auto" if parsed else "none")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        choice = ToolChoice("function", fn.get("name") if isinstance(fn, dict) else None)
    else:
        choice = ToolChoice(choice)
    return OutputRules(_response_format(_given(body, "response_format", None)), tuple(parsed), choice,
                       _given(body, "parallel_tool_calls", True))


def _response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("response_format must be an object with a type", "response_format")
    kind = value.get("type")
    if kind != "json_schema":
        return ResponseFormat(kind)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("response_format.json_schema must be an object with name and schema", "response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("response_format.json_schema.strict must be a boolean", "response_format")
    return ResponseFormat("json_schema", _given(spec, "schema", {}), spec.get("name"))


def _sampling(body: dict[str, Any], limits: Limits) -> SamplingParams:
    """Wire shapes only (JSON arrays and maps into tuples); SamplingParams checks every value."""
    stop = _given(body, "stop", [])
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise RequestError(f"stop must be a string or an array of at most {MAX_STOP_STRINGS} strings", "stop")
    stop_ids = _given(body, "stop_token_ids", [])
    if not isinstance(stop_ids, list):
        raise RequestError("stop_token_ids must be an array of non-negative integers", "stop_token_ids")
    bias = _given(body, "logit_bias", {})
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must map token ids to numbers", "logit_bias")
    # JSON object keys are strings; only plain decimal ones name a token (int() would also take "1_0", " 7").
    if not all(k.isascii() and k.isdigit() for k in bias):
        raise RequestError("logit_bias must map token ids (decimal strings) to numbers", "logit_bias")
    logit_bias = tuple(sorted((int(k), v) for k, v in bias.items()))
    return SamplingParams(
        max_tokens=resolve_max_tokens(body.get("max_completion_tokens", body.get("max_tokens")),
                                      limits.default_max_tokens, limits.max_tokens_limit),
        temperature=_given(body, "temperature", 1.0),
        top_p=_given(body, "top_p", 1.0),
        top_k=_given(body, "top_k", 0),
        min_p=_given(body, "min_p", 0.0),
        seed=body.get("seed"),
        stop=stop,
        stop_token_ids=tuple(stop_ids),
        logit_bias=logit_bias,
        repetition_penalty=body.get("repetition_penalty"),
        presence_penalty=_given(body, "presence_penalty", 0.0),
        frequency_penalty=_given(body, "frequency_penalty", 0.0),
    )


def _given(body: dict[str, Any], key: str, default: Any) -> Any:
    """The field's value; JSON null means not given, as OpenAI's API treats it."""
    value = body.get(key)
    return default if value is None else value


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = _given(body, key, default)
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be a boolean", key)
    return v


# --- responses ------------------------------------------------------------------


def _envelope(job_id: str, model: str, obj: str, created: int) -> dict[str, Any]:
    return {"id": job_id, "object": obj, "created": created, "model": model}


def chat_response(job_id: str, model: str, text: str, done: Done, created: int,
                  calls: list[ToolCall] = ()) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = [tool_call_dict(c) for c in calls]
    return _envelope(job_id, model, "chat.completion", created) | {
        "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": None}],
        "usage": done.usage.as_dict(),
        "telemetry": done.telemetry.as_dict(),
    }


def completion_response(job_id: str, model: str, text: str, done: Done, created: int) -> dict[str, Any]:
    return _envelope(job_id, model, "text_completion", created) | {
        "choices": [{"index": 0, "text": text, "finish_reason": done.finish_reason, "logprobs": None}],
        "usage": done.usage.as_dict(),
        "telemetry": done.telemetry.as_dict(),
    }


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_deltas(calls: list[ToolCall], first_index: int) -> list[list[dict[str, Any]]]:
    """Each call as OpenAI streams one: a delta with its index, id and name, then one with its arguments."""
    out = []
    for i, c in enumerate(calls, first_index):
        out.append([{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}])
        out.append([{"index": i, "function": {"arguments": c.arguments}}])
    return out


def chat_chunk(job_id: str, model: str, created: int, *, text: str | None = None, role: bool = False,
               finish_reason: str | None = None, tool_calls: list[dict] | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return _envelope(job_id, model, "chat.completion.chunk", created) | {
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    }


def completion_chunk(job_id: str, model: str, created: int, *, text: str = "",
                     finish_reason: str | None = None) -> dict[str, Any]:
    return _envelope(job_id, model, "text_completion", created) | {
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]
    }


def usage_chunk(job_id: str, model: str, created: int, obj: str, done: Done) -> dict[str, Any]:
    """The last chunk before [DONE]: no choices, usage and telemetry (as with include_usage)."""
    return _envelope(job_id, model, obj, created) | {
        "choices": [], "usage": done.usage.as_dict(), "telemetry": done.telemetry.as_dict()
    }


def health_body(st: NodeStatus) -> dict[str, Any]:
    return {
        "status": st.health,
        "default_model": st.default_model,
        "models": [m.id for m in st.models],
        "resident_models": st.resident,
        "resident": [{k: v for k, v in dataclasses.asdict(m).items() if k != "facts"}
                     for m in st.models if m.state != "available"],
        "memory": dataclasses.asdict(st.memory),
        "active_jobs": st.active_jobs,
        "queued_jobs": st.queued_jobs,
        "queue": dataclasses.asdict(st.queue),
        "counters": dataclasses.asdict(st.counters),
    }


def now() -> int:
    return int(time.time())


