"""Anthropic's Messages API at the edge: a request body -> one Job (chat messages in the node's wire shape,
OutputRules, sampling), and the job's result -> a Message body; errors in Anthropic's shape. Pure: no I/O.

What maps where: `system` -> a leading system message; text and base64 image blocks -> content parts; an
assistant's `tool_use` blocks -> its tool_calls; a user's `tool_result` blocks -> tool messages (before the
user's other content); `thinking` blocks passed back -> left out (the node does not think in Anthropic's
format); `tools` -> functions (hosted tool types left out); `tool_choice` auto/any/tool/none ->
auto/required/function/none, `disable_parallel_tool_use` -> parallel_tool_calls false; `stop_sequences` ->
stop. `cache_control` is accepted anywhere: the node keeps recent prefixes by itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..constraints import MAX_ARGUMENTS_CHARS, OutputRules, ToolChoice
from ..content import IMAGE_PART, ImageInput
from ..jobs import Job, JobError, SamplingParams
from ..outputs import Done, ToolCall
from ..types import FinishReason
from . import openai_api as api
from .agent_edge import EdgeNotes, agent_tool, bounded_tools, check_max_tokens, check_tools_sent
from .image_parts import data_url_bytes

SERVED = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                    "tools", "tool_choice", "stream", "metadata", "cache_control"})
MAX_MESSAGES = 100_000  # Anthropic's own cap on a request's messages

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
               504: "api_error"}


def error_body(e: api.RequestError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass(frozen=True)
class MessagesRequest:
    job: Job
    stream: bool
    notes: EdgeNotes
    tools: int  # functions offered


def parse_messages(body: Any, job_id: str, limits: api.Limits, *, counting: bool = False) -> MessagesRequest:
    """POST /v1/messages (or, `counting`, /v1/messages/count_tokens, which has no max_tokens)."""
    if not isinstance(body, dict):
        raise api.RequestError("the request body must be a JSON object")
    notes = EdgeNotes("anthropic_messages")
    notes.fields(body, SERVED | ({"max_tokens"} if counting else set()))
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise api.RequestError("model must be a string", "model")
    messages, images = _messages(body, notes)
    rules = _rules(body, notes)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise api.RequestError("stream must be a boolean", "stream")
    asked = body.get("max_tokens")
    if not counting:
        check_max_tokens(asked, "max_tokens")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise api.RequestError("stop_sequences must be an array of strings", "stop_sequences")
    try:
        sampling = SamplingParams(
            max_tokens=1 if counting else notes.clamp(asked, limits.default_max_tokens, limits.max_tokens_limit),
            temperature=_given(body, "temperature", 1.0), top_p=_given(body, "top_p", 1.0),
            top_k=_given(body, "top_k", 0), stop=tuple(stop))
        job = Job(id=job_id, model=model, sampling=sampling, messages=tuple(messages), rules=rules,
                  images=tuple(images), keep_alive=body.get("keep_alive"))
    except JobError as e:
        raise api.RequestError(e.message, e.param) from None
    return MessagesRequest(job, stream and not counting, notes, len(rules.tools))


def _given(body: dict, key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise api.RequestError(f"{param} must be a string", param)
    return value


def _system(value: Any, notes: EdgeNotes) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise api.RequestError("system must be a string or an array of text blocks", "system")
    texts = []
    for j, b in enumerate(value):
        if not isinstance(b, dict):
            raise api.RequestError(f"system[{j}] must be a text block", "system")
        if b.get("type") == "text":
            texts.append(_text(b.get("text"), f"system[{j}].text"))
        else:
            notes.leave_out(f"system block {str(b.get('type'))[:32]}")
    return "\n".join(texts)


def _messages(body: dict, notes: EdgeNotes) -> tuple[list[dict], list[ImageInput]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise api.RequestError("messages must be a non-empty array of {role, content} objects", "messages")
    out: list[dict] = []
    images: list[ImageInput] = []
    system = body.get("system")
    if system is not None:
        text = _system(system, notes)
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise api.RequestError(f"{param} must be an object with role user, assistant or system and content",
                                   f"{param}.role")
        if m["role"] == "system":  # Claude Code sends these between turns: instructions, as a system message
            out.append({"role": "system", "content": _system(m.get("content"), notes)})
        else:
            out += _message(m["role"], m.get("content"), param, images, notes)
    return out, images


def _message(role: str, content: Any, param: str, images: list[ImageInput], notes: EdgeNotes) -> list[dict]:
    """One Anthropic message as the node's messages: tool results first (as tool messages), then the rest."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise api.RequestError(f"{param}.content must be a string or an array of content blocks", f"{param}.content")
    parts: list[dict] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, b in enumerate(content):
        where = f"{param}.content[{j}]"
        if not isinstance(b, dict):
            raise api.RequestError(f"{where} must be a content block object", where)
        kind = b.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text(b.get("text"), f"{where}.text")})
        elif kind == "image":
            images.append(_image(b, where))
            parts.append(dict(IMAGE_PART))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(b, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(b, where, notes))
        elif kind in ("thinking", "redacted_thinking"):
            notes.leave_out("thinking blocks")
        else:
            notes.leave_out(f"{role} content block {str(kind)[:32]}")
    out = list(results)
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": _joined(parts, where=param)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif parts or not results:
        out.append({"role": "user", "content": _joined(parts, where=param)})
    return out


def _joined(parts: list[dict], where: str) -> str | list[dict]:
    """Text blocks as one string (a newline between them); with images, the parts as they are."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image(b: dict, where: str) -> ImageInput:
    source = b.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise api.RequestError(f"{where}: an image's source must be {{type: base64, media_type, data}}; the node "
                               "does not fetch URLs", where)
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str) or ";" in media or "," in media:
        raise api.RequestError(f"{where}.source needs media_type and data strings", where)
    try:
        return ImageInput(data_url_bytes(f"data:{media};base64,{data}", where), "auto", where)
    except JobError as e:
        raise api.RequestError(e.message, e.param) from None


def _tool_use(b: dict, where: str) -> dict:
    name, args, call_id = b.get("name"), b.get("input"), b.get("id")
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, dict):
        raise api.RequestError(f"{where}: a tool_use block needs id, name and an input object", where)
    arguments = json.dumps(args)
    if len(arguments) > MAX_ARGUMENTS_CHARS:
        raise api.RequestError(f"{where}.input must be at most {MAX_ARGUMENTS_CHARS} characters as JSON", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(b: dict, where: str, notes: EdgeNotes) -> dict:
    call_id, content = b.get("tool_use_id"), b.get("content")
    if not isinstance(call_id, str):
        raise api.RequestError(f"{where}.tool_use_id must be a string", where)
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(_text(part.get("text"), f"{where}.content[{k}].text"))
            elif isinstance(part, dict):
                notes.leave_out(f"tool_result block {str(part.get('type'))[:32]}")
            else:
                raise api.RequestError(f"{where}.content[{k}] must be a content block object", where)
        text = "\n".join(texts)
    else:
        raise api.RequestError(f"{where}.content must be a string or an array of blocks", where)
    if b.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _rules(body: dict, notes: EdgeNotes) -> OutputRules:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise api.RequestError("tools must be an array of {name, description, input_schema}", "tools")
    check_tools_sent(len(tools))
    offered = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise api.RequestError(f"tools[{i}] must be an object", "tools")
        kind = t.get("type")
        if kind not in (None, "custom"):  # a server tool (web_search, bash, text_editor...): the node runs none
            notes.leave_out(f"hosted tool {str(kind)[:48]}")
            continue
        tool = agent_tool(t.get("name"), t.get("description"), t.get("input_schema"), notes, f"tools[{i}]")
        if tool is not None:
            offered.append(tool)
    offered = bounded_tools(offered, notes)
    choice = body.get("tool_choice")
    if choice is None:
        choice = {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise api.RequestError("tool_choice must be {type: auto | any | tool | none}", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise api.RequestError("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    mode, name = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[choice["type"]], None
    if mode == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise api.RequestError("tool_choice {type: tool} needs name", "tool_choice")
        if name not in {t.name for t in offered}:
            notes.leave_out(f"tool_choice {name[:64]} (not among the tools offered)")
            mode, name = "auto", None
    if not offered:
        if mode != "none" and tools:
            notes.leave_out(f"tool_choice {choice['type']} (no function tools left to offer)")
        mode, name = "none", None
    try:
        return OutputRules(tools=offered, tool_choice=ToolChoice(mode, name), parallel_tool_calls=not parallel)
    except JobError as e:
        raise api.RequestError(e.message, e.param) from None


# --- the answer -----------------------------------------------------------------------


def stop_reason(done: Done) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the job ended."""
    if done.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_use", None
    if done.finish_reason in (FinishReason.LENGTH, FinishReason.CANCELLED):  # cut short: as the output stands
        return "max_tokens", None
    if done.stop_sequence is not None:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
            "input": args if isinstance(args, dict) else {}}


def usage(done: Done | None) -> dict[str, Any]:
    if done is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0}
    u = done.usage
    return {"input_tokens": u.prompt_tokens - u.cached_prompt_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_prompt_tokens, "cache_creation_input_tokens": 0}


def message_body(msg_id: str, model: str, text: str, calls: list[ToolCall], done: Done,
                 notes: EdgeNotes) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
    content += [tool_use_block(c) for c in calls]
    reason, sequence = stop_reason(done)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(done),
            "telemetry": notes.telemetry(done)}
