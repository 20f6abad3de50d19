"""OpenAI request bodies -> Jobs (one per choice), and job failures -> OpenAI errors. Pure: no I/O, no MLX.
The response bodies are in chat_output."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..constraints import MAX_TOOLS, OutputRules, ResponseFormat, Tool, ToolChoice
from ..content import ImageInput, VideoInput
from ..jobs import MAX_PROMPT_IDS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, Job, JobError, SamplingParams, resolve_max_tokens
from ..types import Cause
from .image_parts import content_parts


MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 64  # prompts x n: the jobs one request may start
MAX_TOKEN_ID_DIGITS = 100  # a logit_bias key: past any vocabulary (refused as such), short of int()'s 4,300


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
    Cause.GROUP_LOST: (503, "server_error"),
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
    """One request: a job per choice, by index (prompt p's n choices are p*n .. p*n + n-1)."""

    jobs: tuple[Job, ...]
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False
    logprobs: bool = False  # the response shows logprobs (chat: logprobs true; completions: an integer)

    @property
    def job(self) -> Job:
        return self.jobs[0]


def parse_chat(body: Any, job_id: str, limits: Limits) -> ParsedRequest:
    body = _object(body)
    chat = _chat_prompt(body)
    wants = _bool(body, "logprobs", False)
    top = _given(body, "top_logprobs", None)  # its bounds are SamplingParams' (which names top_logprobs)
    if top is not None and not wants:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    return _finish(body, job_id, limits, [chat], logprobs=(top or 0) if wants else None)


def _chat_prompt(body: dict) -> dict[str, Any]:
    """A chat's messages in their wire shape, with the images and videos their parts carry, as `Job` fields."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty array of {role, content} objects", "messages")
    images: list[ImageInput] = []
    videos: list[VideoInput] = []
    try:
        parsed = tuple(_message(m, i, images, videos) for i, m in enumerate(messages))
    except JobError as e:
        raise RequestError(e.message, e.param) from None
    return {"messages": parsed, "images": tuple(images), "videos": tuple(videos)}


def parse_completion(body: Any, job_id: str, limits: Limits) -> ParsedRequest:
    body = _object(body)
    logprobs = _given(body, "logprobs", None)
    if logprobs is False:
        logprobs = None
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (how many alternatives to "
                           "show per token)", "logprobs")
    return _finish(body, job_id, limits, prompts_of(body.get("prompt")), logprobs=logprobs,
                   echo=_bool(body, "echo", False))


def prompts_of(prompt: Any) -> list[dict[str, Any]]:
    """A string, an array of strings, an array of token ids, or an array of token-id arrays: one prompt each."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
                                   and not isinstance(prompt[0], bool)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt must be a string, an array of strings, an array of token ids or an array of "
                           "token-id arrays", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"prompt may hold at most {MAX_PROMPTS} prompts", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise RequestError("prompt must not be empty", "prompt")
            out.append({"prompt": p})
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append({"prompt_ids": tuple(p)})  # each id is checked by Job, then against the model's vocabulary
        else:
            raise RequestError("prompt must be a string, an array of strings, an array of token ids or an array "
                               "of token-id arrays (none empty)", "prompt")
    return out


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _message(m: Any, i: int, images: list[ImageInput], videos: list[VideoInput]) -> dict[str, Any]:
    """The wire shape of one message; its role and text are checked by `Job`, its images when prepared."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{param} must be an object with role and content", param)
    content = m.get("content")
    if isinstance(content, list):
        content = content_parts(content, param, images, videos)
    if content is None and m.get("role") == "assistant":
        content = ""
    if not isinstance(content, (str, list)):
        raise RequestError(f"{param}.content must be a string or an array of content parts", f"{param}.content")
    role = m.get("role")
    # OpenAI's newer name for system instructions; every chat template knows `system`, few know `developer`.
    out = {"role": "system" if role == "developer" else role, "content": content}
    for key in ("tool_calls", "tool_call_id", "name"):  # checked by Job (constraints.check_message_tool_fields)
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _finish(body: dict[str, Any], job_id: str, limits: Limits, prompts: list[dict[str, Any]], *,
            logprobs: int | None = None, echo: bool = False) -> ParsedRequest:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    n = _given(body, "n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise RequestError(f"n must be an integer from 1 to {MAX_N}", "n")
    if len(prompts) * n > MAX_CHOICES:
        raise RequestError(f"prompts x n must be at most {MAX_CHOICES} choices", "n")
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise RequestError(f"{key} is OpenAI's deprecated form; send tools and tool_choice", key)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    try:
        sampling = _sampling(body, limits, least=0 if echo else 1)
        scored = echo and logprobs is not None
        # echo with max_tokens 0 only reads the prompt: a scoring job (its logprobs shown only when asked)
        sampling = replace(sampling, logprobs=logprobs, prompt_logprobs=scored or sampling.max_tokens == 0)
        rules, speculation = output_rules(body), _given(body, "speculation", "auto")
        jobs = []
        for p, prompt in enumerate(prompts):
            for c in range(n):
                # Choice c of a prompt: seed + c (so its choice 0 is what the same request with n=1 gives); the
                # first keeps the prompt's KV for the others, and only it scores the prompt.
                own = replace(sampling, seed=None if sampling.seed is None else sampling.seed + c,
                              prompt_logprobs=(scored and c == 0) or sampling.max_tokens == 0)
                jobs.append(Job(id=job_id if len(prompts) * n == 1 else f"{job_id}-{p * n + c}", model=model,
                                sampling=own, rules=rules, speculation=speculation, share_prompt=n > 1 and c == 0,
                                keep_alive=body.get("keep_alive"), **prompt))
    except JobError as e:  # the shared bounds (jobs.py, constraints.py), reported against the field at fault
        raise RequestError(e.message, e.param) from None
    return ParsedRequest(tuple(jobs), stream, _bool(options, "include_usage", False), n, echo, logprobs is not None)


def output_rules(body: dict[str, Any]) -> OutputRules:
    """response_format, tools, tool_choice and parallel_tool_calls: wire shapes into OutputRules (which checks
    every value)."""
    tools = _given(body, "tools", [])
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:  # counted before any is built
        raise RequestError(f"tools must be an array of at most {MAX_TOOLS} {{type: function, function: {{...}}}}",
                           "tools")
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


def _sampling(body: dict[str, Any], limits: Limits, least: int = 1) -> SamplingParams:
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
    # JSON object keys are strings; only plain decimal ones name a token (int() would also take "1_0", " 7", and
    # raise on 4,301 digits: a 500 then).
    if not all(k.isascii() and k.isdigit() and len(k) <= MAX_TOKEN_ID_DIGITS for k in bias):
        raise RequestError(f"logit_bias must map token ids (decimal strings of at most {MAX_TOKEN_ID_DIGITS} digits) "
                           "to numbers", "logit_bias")
    logit_bias = tuple(sorted((int(k), v) for k, v in bias.items()))
    max_tokens = resolve_max_tokens(body.get("max_completion_tokens", body.get("max_tokens")),
                                    limits.default_max_tokens, limits.max_tokens_limit, least)
    return SamplingParams(
        max_tokens=max_tokens,
        prompt_logprobs=max_tokens == 0,  # (only echo allows 0) a job that reads its prompt and ends
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


def parse_tokenize(body: Any, job_id: str) -> tuple[Job, bool]:
    """POST /tokenize (vLLM's shape): {model, prompt, add_special_tokens} or {model, messages}, as a job that is
    only encoded, and whether to add special tokens (BOS) to a raw prompt."""
    body = _object(body)
    model = _given(body, "model", "")
    if not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    if body.get("add_generation_prompt") not in (None, True):
        raise RequestError("only add_generation_prompt true is served (the ids a chat completion would see)",
                           "add_generation_prompt")
    if "messages" in body:
        prompt = _chat_prompt(body)
    else:
        prompt = prompts_of(body.get("prompt"))
        if len(prompt) != 1 or "prompt" not in prompt[0]:
            raise RequestError("prompt must be a string", "prompt")
        prompt = prompt[0]
    try:
        return Job(id=job_id, model=model, sampling=SamplingParams(max_tokens=1), **prompt), \
            _bool(body, "add_special_tokens", True)
    except JobError as e:
        raise RequestError(e.message, e.param) from None


def parse_detokenize(body: Any) -> tuple[str, list[int]]:
    """POST /detokenize (vLLM's shape): {model, tokens}."""
    body = _object(body)
    model, tokens = _given(body, "model", ""), body.get("tokens")
    if not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    if not isinstance(tokens, list) or len(tokens) > MAX_PROMPT_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise RequestError(f"tokens must be an array of at most {MAX_PROMPT_IDS} non-negative token ids", "tokens")
    return model, tokens
