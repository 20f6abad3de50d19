"""OpenAI's Responses API at the edge: a request body (and the stored conversation its previous_response_id
names) -> one Job. Pure: no I/O. The response objects and stream events are in responses_output.

What maps where: `instructions` -> a leading system message (not carried to the next response, as OpenAI
does); input messages (input_text / output_text / input_image parts; developer as system) -> messages;
`function_call` items -> an assistant's tool_calls; `function_call_output` -> tool messages; `reasoning`
items and hosted tool calls -> left out; `tools` of type function -> functions, a `namespace` group's functions
-> functions, hosted tools (web_search, file_search...) -> left out; `text.format` -> response_format;
`max_output_tokens` -> max_tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..constraints import MAX_ARGUMENTS_CHARS, OutputRules, ResponseFormat, Tool, ToolChoice
from ..content import IMAGE_PART, ImageInput
from ..jobs import Job, JobError, SamplingParams
from . import openai_api as api
from .agent_edge import EdgeNotes, agent_tool, bounded_tools, check_max_tokens, check_tools_sent
from .image_parts import image_input

SERVED = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
                    "metadata"})
MAX_ITEMS = 100_000


@dataclass(frozen=True)
class ResponsesRequest:
    job: Job
    stream: bool
    store: bool
    notes: EdgeNotes
    items: list[dict[str, Any]]  # the conversation's items so far (stored ones first), as the next turn resends
    echo: dict[str, Any]  # the request's fields a response object repeats
    tools: int


def input_items(body: Any) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise api.RequestError("input must be a string or an array of items", "input")
    return value


def parse_responses(body: Any, job_id: str, limits: api.Limits, prior: tuple[dict, ...] = ()) -> ResponsesRequest:
    """POST /v1/responses; `prior`: the stored items of previous_response_id."""
    if not isinstance(body, dict):
        raise api.RequestError("the request body must be a JSON object")
    notes = EdgeNotes("openai_responses")
    notes.fields(body, SERVED)
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise api.RequestError("model must be a string", "model")
    items = list(prior) + input_items(body)
    if not items or len(items) > MAX_ITEMS:
        raise api.RequestError(f"input must hold 1 to {MAX_ITEMS} items, the stored ones of previous_response_id "
                               "counted", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise api.RequestError("instructions must be a string", "instructions")
    messages, images = _messages(items, notes)
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    if not any(m["role"] != "system" for m in messages):
        raise api.RequestError("input must hold at least one message or function call output", "input")
    rules, tools = _rules(body, notes)
    flags = {k: body.get(k) if body.get(k) is not None else d for k, d in (("stream", False), ("store", True))}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise api.RequestError(f"{k} must be a boolean", k)
    asked = body.get("max_output_tokens")
    check_max_tokens(asked, "max_output_tokens")
    try:
        sampling = SamplingParams(max_tokens=notes.clamp(asked, limits.default_max_tokens, limits.max_tokens_limit),
                                  temperature=_given(body, "temperature", 1.0), top_p=_given(body, "top_p", 1.0))
        job = Job(id=job_id, model=model, sampling=sampling, messages=tuple(messages), rules=rules,
                  images=tuple(images), keep_alive=body.get("keep_alive"))
    except JobError as e:
        raise api.RequestError(e.message, e.param) from None
    echo = {"instructions": instructions, "max_output_tokens": asked, "parallel_tool_calls": rules.parallel_tool_calls,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "tools": tools,
            "tool_choice": body.get("tool_choice") or "auto", "text": body.get("text") or {"format": {"type": "text"}},
            "previous_response_id": body.get("previous_response_id"), "metadata": _metadata(body, notes),
            "store": flags["store"], "reasoning": None, "truncation": "disabled", "user": None}
    return ResponsesRequest(job, flags["stream"], flags["store"], notes, items, echo, len(rules.tools))


def _metadata(body: dict, notes: EdgeNotes) -> dict[str, str]:
    """Echoed as sent within OpenAI's bounds (16 pairs of strings, keys of 64 characters, values of 512); else
    left out."""
    value = body.get("metadata") or {}
    if isinstance(value, dict) and len(value) <= 16 and all(
            len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        return value
    notes.leave_out("metadata (past OpenAI's bounds: 16 pairs of strings, keys of 64 and values of 512 characters)")
    return {}


def _given(body: dict, key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def _messages(items: list, notes: EdgeNotes) -> tuple[list[dict], list[ImageInput]]:
    out: list[dict] = []
    images: list[ImageInput] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise api.RequestError(f"{param} must be an item object", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, param, images))
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, param)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append(_output(item, param, notes))
        elif kind == "reasoning":
            notes.leave_out("reasoning items")
        else:
            notes.leave_out(f"input item {str(kind)[:48]}")
    return out, images


def _message(item: dict, param: str, images: list[ImageInput]) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise api.RequestError(f"{param}.role must be user, assistant, system or developer", f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        text: str | list = content
    elif isinstance(content, list):
        parts: list[dict] = []
        for j, part in enumerate(content):
            where = f"{param}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text", "refusal"):
                value = part.get("text", part.get("refusal"))
                if not isinstance(value, str):
                    raise api.RequestError(f"{where}.text must be a string", where)
                parts.append({"type": "text", "text": value})
            elif kind == "input_image":
                try:
                    images.append(image_input({"image_url": part.get("image_url"), "detail": part.get("detail")},
                                              where))
                except JobError as e:
                    raise api.RequestError(e.message, e.param) from None
                parts.append(dict(IMAGE_PART))
            else:
                raise api.RequestError(f"{where} must be an input_text, output_text or input_image part (files "
                                       "and audio are not supported)", where)
        text = "".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts) else parts
    else:
        raise api.RequestError(f"{param}.content must be a string or an array of parts", f"{param}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _call(item: dict, param: str) -> dict:
    name, call_id = item.get("name"), item.get("call_id")
    args = item.get("arguments") if item.get("type", "function_call") == "function_call" else \
        json.dumps({"input": item.get("input")})
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
        raise api.RequestError(f"{param}: a function_call item needs call_id, name and arguments strings", param)
    if len(args) > MAX_ARGUMENTS_CHARS:
        raise api.RequestError(f"{param}.arguments must be at most {MAX_ARGUMENTS_CHARS} characters", param)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _output(item: dict, param: str, notes: EdgeNotes) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise api.RequestError(f"{param}.call_id must be a string", param)
    if isinstance(output, list):  # content parts: their text kept
        texts = []
        for part in output:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                notes.leave_out("non-text function_call_output parts")
        output = "\n".join(texts)
    if not isinstance(output, str):
        raise api.RequestError(f"{param}.output must be a string or an array of parts", param)
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _functions(tools: Any, notes: EdgeNotes, param: str, depth: int = 0) -> list[Tool]:
    if not isinstance(tools, list):
        raise api.RequestError(f"{param} must be an array of tools", param)
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(t, dict):
            raise api.RequestError(f"{where} must be an object", param)
        kind = t.get("type")
        if kind == "function":
            fn = t.get("function") if isinstance(t.get("function"), dict) else t  # Chat's nesting, sent by some
            tool = agent_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), notes, where)
            if tool is not None:
                out.append(tool)
        elif kind == "namespace" and depth == 0:  # a group of functions: each offered as a function
            out += _functions(t.get("tools", t.get("functions", [])), notes, f"{where}.tools", depth + 1)
        else:
            notes.leave_out(f"hosted tool {str(kind)[:48]}")
    return out


def _entries(tools: Any) -> int:
    """The tools sent, a namespace's members counted with it."""
    if not isinstance(tools, list):
        return 0
    members = (t.get("tools", t.get("functions")) for t in tools
               if isinstance(t, dict) and t.get("type") == "namespace")
    return len(tools) + sum(len(m) for m in members if isinstance(m, list))


def _rules(body: dict, notes: EdgeNotes) -> tuple[OutputRules, list[dict]]:
    """OutputRules, and the functions offered as the response object lists them."""
    raw = body.get("tools")
    check_tools_sent(_entries(raw))
    offered = bounded_tools(_functions(raw if raw is not None else [], notes, "tools"), notes)
    choice = body.get("tool_choice")
    mode, name = ("auto" if offered else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise api.RequestError("tool_choice must be auto, none, required or {type: function, name}",
                                   "tool_choice")
        mode = choice
    elif isinstance(choice, dict):
        if choice.get("type") == "function":
            name = choice.get("name")
            if not isinstance(name, str):
                raise api.RequestError("tool_choice {type: function} needs name", "tool_choice")
            mode = "function"
            if name not in {t.name for t in offered}:
                notes.leave_out(f"tool_choice {name[:64]} (not among the functions offered)")
                mode, name = "auto", None
        else:
            notes.leave_out(f"tool_choice {str(choice.get('type'))[:48]}")
    elif choice is not None:
        raise api.RequestError("tool_choice must be a string or an object", "tool_choice")
    if not offered:
        mode, name = "none", None
    parallel = body.get("parallel_tool_calls")
    try:
        rules = OutputRules(_format(body.get("text"), notes), offered, ToolChoice(mode, name),
                            True if parallel is None else parallel)
    except JobError as e:
        raise api.RequestError(e.message, e.param) from None
    listed = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
               "strict": False} for t in offered]
    return rules, listed


def _format(text: Any, notes: EdgeNotes) -> ResponseFormat | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise api.RequestError("text must be an object with a format", "text")
    for key in text:
        if key != "format" and text[key] is not None:
            notes.leave_out(f"text.{str(key)[:32]}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise api.RequestError("text.format must be {type: text | json_object | json_schema}", "text.format")
    if fmt["type"] != "json_schema":
        return ResponseFormat(fmt["type"])
    try:
        return ResponseFormat("json_schema", fmt.get("schema"), fmt.get("name"))
    except JobError as e:
        raise api.RequestError(e.message, "text.format") from None
