"""What a request may ask its output to be: a JSON shape (`response_format`) or calls of the tools it offers
(`tools`, `tool_choice`). Plain data, checked once for both transports; a leaf beside `jobs`.

Every schema is hostile until bounded: its serialized size, its nesting depth and the number of tools are
capped here, before any grammar is compiled (provider.engine.grammar_compile bounds the compile itself).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from . import strict_json
from .types import Cause, JobError

MAX_TOOLS = 128  # as OpenAI's API
MAX_SCHEMA_BYTES = 64 * 1024  # one schema, serialized
MAX_TOOLS_BYTES = 256 * 1024  # every tool's definition together
MAX_SCHEMA_DEPTH = 24  # objects and arrays nested in a schema
MAX_DESCRIPTION_CHARS = 8192
MAX_TOOL_CALLS_IN_MESSAGE = 64
MAX_ARGUMENTS_CHARS = 64 * 1024
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
TOOL_CHOICE_MODES = ("none", "auto", "required")


class ConstraintError(JobError):
    """A bad `response_format`, `tools`, `tool_choice` or message tool field; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(Cause.INVALID_REQUEST, message, param)


@dataclass(frozen=True)
class ResponseFormat:
    type: str  # text | json_object | json_schema
    schema: dict | None = None  # json_schema's
    name: str = ""

    def __post_init__(self) -> None:
        if self.type not in ("text", "json_object", "json_schema"):
            raise ConstraintError("response_format", "response_format.type must be text, json_object or "
                                                     f"json_schema, got {short(self.type)}")
        if self.type == "json_schema":
            if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
                raise ConstraintError("response_format", "response_format.json_schema.name must be 1 to 64 "
                                                         "letters, digits, '_' or '-'")
            check_schema("response_format", self.schema)

    @property
    def json(self) -> bool:
        return self.type != "text"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema of the arguments object
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ConstraintError("tools", f"a tool's function.name must be 1 to 64 letters, digits, '_' or '-', "
                                           f"got {short(self.name)}")
        if not isinstance(self.description, str) or len(self.description) > MAX_DESCRIPTION_CHARS:
            raise ConstraintError("tools", f"function.description of {self.name} must be a string of at most "
                                           f"{MAX_DESCRIPTION_CHARS} characters")
        check_schema("tools", self.parameters)
        if self.parameters.get("type", "object") != "object":
            raise ConstraintError("tools", f"function.parameters of {self.name} must be an object schema")

    def as_openai(self) -> dict:
        """The tool as chat templates expect it (OpenAI's shape)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | function
    name: str | None = None  # the function a named choice forces

    def __post_init__(self) -> None:
        if self.mode not in (*TOOL_CHOICE_MODES, "function"):
            raise ConstraintError("tool_choice", "tool_choice must be none, auto, required or "
                                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if (self.mode == "function") != (self.name is not None):
            raise ConstraintError("tool_choice", "a named tool_choice needs function.name")

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class OutputRules:
    """A job's output constraints, resolved: what the grammar must allow."""

    response_format: ResponseFormat | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.tools, tuple) or len(self.tools) > MAX_TOOLS:
            raise ConstraintError("tools", f"tools must be an array of at most {MAX_TOOLS} functions")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ConstraintError("tools", "tools must not repeat a function name")
        if self.tools_chars > MAX_TOOLS_BYTES:
            raise ConstraintError("tools", f"tools must total at most {MAX_TOOLS_BYTES} bytes of definitions")
        if self.tool_choice.mode != "none" and not self.tools:
            raise ConstraintError("tool_choice", "tool_choice needs tools")
        if self.tool_choice.name is not None and self.tool_choice.name not in names:
            raise ConstraintError("tool_choice", f"tool_choice names {short(self.tool_choice.name)}, "
                                                 "which is not among the tools")
        if not isinstance(self.parallel_tool_calls, bool):
            raise ConstraintError("parallel_tool_calls", "parallel_tool_calls must be a boolean")

    @functools.cached_property  # the edge and the prompt bound both ask; the dumps of 256 KiB is done once
    def tools_chars(self) -> int:
        """The tools' definitions in characters, as a prompt would carry them."""
        return sum(len(json.dumps(t.parameters)) + len(t.description) + len(t.name) for t in self.tools)

    @property
    def calls_tools(self) -> bool:
        return self.tool_choice.mode != "none"

    @property
    def json_content(self) -> bool:
        return self.response_format is not None and self.response_format.json

    @property
    def constrained(self) -> bool:
        """A grammar may decide what is generated: JSON content and forced calls from the first token; under
        `auto`, a call from its opening marker on (in a format with a call grammar; the text is free)."""
        return self.json_content or self.calls_tools

    @property
    def kind(self) -> str:
        """The constraint, as telemetry reports it."""
        if self.tool_choice.forced:
            return "tool_call"
        if self.json_content:
            return self.response_format.type + ("+tools" if self.calls_tools else "")
        return "tools_auto" if self.calls_tools else "none"

    def content_schema(self) -> dict | None:
        if not self.json_content:
            return None
        return self.response_format.schema if self.response_format.type == "json_schema" else {"type": "object"}

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools a call may name: the one a named choice forces, else all."""
        return (self.tool(self.tool_choice.name),) if self.tool_choice.name else self.tools


NO_RULES = OutputRules()


def check_schema(param: str, schema: Any) -> None:
    """A JSON schema within the size and depth bounds (its keywords are checked by the grammar compiler)."""
    if not isinstance(schema, dict):
        raise ConstraintError(param, f"{param}: a schema must be a JSON object")
    stack = [(schema, 1)]  # depth first, iteratively: a schema nested a million deep must not exhaust the stack
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintError(param, f"{param}: a schema may nest at most {MAX_SCHEMA_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    try:
        size = len(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ConstraintError(param, f"{param}: the schema is not plain JSON ({e})") from None
    if size > MAX_SCHEMA_BYTES:
        raise ConstraintError(param, f"{param}: a schema must be at most {MAX_SCHEMA_BYTES} bytes, got {size}")
    _check_keywords(param, schema)


# What llguidance enforces of JSON Schema, and what only annotates. Anything else is refused: a keyword the
# grammar would skip silently is a promise the node would break.
ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
            "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minimum",
            "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern",
            "format", "minProperties", "maxProperties", "patternProperties"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "discriminator"}
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
SCHEMA_VALUES = ("items", "additionalProperties")


def closed(schema: dict) -> dict:
    """The schema with every object that lists its properties closed to others unless it says otherwise (as
    xgrammar's strict mode, vLLM's default, and OpenAI's strict schemas): a generator told "an object with these
    fields" writes those fields, and a small model cannot wander into inventing keys forever."""
    out = copy.deepcopy(schema)
    for node in subschemas(out):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return out


def subschemas(schema: dict, most: int | None = None):
    """Every schema object within `schema` (itself included), at most `most` of them. A node's subschemas are
    read after the caller has seen it, so a keyword it deletes is not walked into."""
    stack, seen = [schema], 0
    while stack and (most is None or seen < most):
        node = stack.pop()
        seen += 1
        if not isinstance(node, dict):
            continue
        yield node
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack.extend(node[key] for key in SCHEMA_VALUES if key in node)


def _check_keywords(param: str, schema: dict) -> None:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise ConstraintError(param, f"{param}: every subschema must be an object or a boolean")
        unknown = sorted(set(node) - ENFORCED - ANNOTATIONS)
        if unknown:
            raise ConstraintError(param, f"{param}: this node cannot enforce the schema keyword(s) {unknown[:5]}; "
                                         "remove them")
        for key in SCHEMA_MAPS:
            if key in node:
                if not isinstance(node[key], dict):
                    raise ConstraintError(param, f"{param}: {key} must be an object of schemas")
                stack.extend(node[key].values())
        for key in SCHEMA_LISTS:
            if key in node:
                if not isinstance(node[key], list):
                    raise ConstraintError(param, f"{param}: {key} must be an array of schemas")
                stack.extend(node[key])
        stack.extend(node[key] for key in SCHEMA_VALUES if key in node)


def check_message_tool_fields(i: int, m: dict) -> None:
    """An assistant message's `tool_calls` and a tool message's `tool_call_id`, as chat templates read them."""
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant" or not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS_IN_MESSAGE:
            raise ConstraintError(f"messages[{i}].tool_calls", f"tool_calls belong to assistant messages, at most "
                                                               f"{MAX_TOOL_CALLS_IN_MESSAGE} of them")
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
                raise ConstraintError(f"messages[{i}].tool_calls", "each tool call needs function.name")
            args = fn.get("arguments")
            if isinstance(args, str) and len(args) <= MAX_ARGUMENTS_CHARS:
                try:  # templates read the arguments as a mapping
                    args = strict_json.loads(args or "{}")
                except (ValueError, RecursionError):
                    args = None
            if not isinstance(args, dict):
                raise ConstraintError(f"messages[{i}].tool_calls", f"function.arguments must be a JSON object, as "
                                                                   f"a string of at most {MAX_ARGUMENTS_CHARS} characters")
            if not isinstance(call.get("id", ""), str):
                raise ConstraintError(f"messages[{i}].tool_calls", "a tool call's id must be a string")
    if m.get("role") == "tool" and not isinstance(m.get("tool_call_id", ""), str):
        raise ConstraintError(f"messages[{i}].tool_call_id", "tool_call_id must be a string")


def short(value: Any) -> str:
    """A value as an error message shows it: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
