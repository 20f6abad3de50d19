"""The Lark grammar (for llguidance) of a tool call in each of mlx-lm's tool formats whose call can be written as
one: what holds a forced call (`required`, a named function) from its first token, and an `auto` call from its
opening marker on. Each is written so that mlx-lm's parser for the format reads it back as the schema's
arguments (the tests parse every one with it and validate).

Two families:
- JSON arguments (generic, json_tools, mistral, kimi_k2, kimi_k3, pythonic's keyword values, muse_spark's
  values): llguidance's JSON compiler enforces the schema (closed objects, `", "` and `": "`).
- one value per parameter between tags (qwen3_coder, glm47, laguna, longcat, minimax_m2, minicpm5,
  function_gemma): the parser converts each value by its schema type, so a parameter must have a plain
  `type` (or be an enum or constant of strings); strings are raw text within their lengths, excluding the
  characters that would close their tag (a pattern or format on a raw string is refused: it cannot be
  enforced on text the grammar writes raw). Others are refused with a 400 naming `tools`.

gemma4 has its own file (gemma4_call_grammar.py). A format not here (none left of mlx-lm's 0.32 list) is
parsed after free generation and refuses `required` and named choices.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Protocol

from ..constraints import ANNOTATIONS, ConstraintError, Tool, closed


class Markers(Protocol):
    """What a call grammar reads of a tool format (tool_format.ToolFormat, which imports this module)."""

    start: str
    end: str
    special_ids: dict[str, int]

    def marker(self, text: str) -> str: ...

JSON_CALL_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_TYPES = ("integer", "number", "boolean", "object", "array")
TEXT_KEYS = {"type", "enum", "const", "minLength", "maxLength"}
MAX_TEXT = 10_000
FUNCTION_GEMMA_EXCLUDED = "<{}"


@dataclass(frozen=True)
class CallGrammar:
    rules: str  # Lark rules defining `call` (one call group, from its opening marker) and `calls` (a forced output)


class _Rules:
    """Lark rules under construction, each named with a prefix of its own."""

    def __init__(self, fmt: Markers):
        self.fmt = fmt
        self.lines: list[str] = []

    def add(self, name: str, body: str) -> str:
        self.lines.append(f"{name}: {body}")
        return name

    def m(self, text: str) -> str:
        return self.fmt.marker(text)

    def json(self, name: str, schema: dict, defs: dict | None = None) -> str:
        """A rule for one JSON value of `schema` (objects closed; the tool's $defs carried along)."""
        s = closed(schema) if isinstance(schema, dict) else {}
        if defs:
            s = {**s, **{k: v for k, v in defs.items() if k not in s}}
        s["x-guidance"] = {**JSON_CALL_SEPARATORS, "lenient": False}
        return self.add(name, f"%json {json.dumps(s)}")

    def done(self, call: str, calls: str) -> CallGrammar:
        return CallGrammar("\n".join([*self.lines, f"call: {call}", f"calls: {calls}"]))


def _defs(schema: dict) -> dict:
    return {k: schema[k] for k in ("$defs", "definitions") if k in schema}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _many(one: str, parallel: bool, sep: str = "") -> str:
    return (f"{one} ({sep} {one})*" if sep else f"{one}+") if parallel else one


# --- JSON arguments ---------------------------------------------------------------------------------------

def json_tools(fmt: Markers, tools: tuple[Tool, ...], parallel: bool) -> CallGrammar:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (generic, json_tools)."""
    r = _Rules(fmt)
    for i, tool in enumerate(tools):
        r.add(f"call_{i}", f"%json {json.dumps(_named_call_schema(tool))}")
    body = " | ".join(f"call_{i}" for i in range(len(tools)))
    return r.done(f'{r.m(fmt.start)} "\\n" ({body}) "\\n" {r.m(fmt.end)}', _many("call", parallel, '"\\n"'))


def _named_call_schema(tool: Tool) -> dict:
    """`{"name": NAME, "arguments": {...}}` as one JSON schema."""
    arguments = closed(tool.parameters)
    # The call wraps the arguments, so the definitions their $refs point at (#/$defs/...) move to its root.
    hoisted = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": {**JSON_CALL_SEPARATORS, "lenient": False}, **hoisted}


def mistral(fmt, tools, parallel):
    """`[TOOL_CALLS]name[ARGS]{...}`, repeated per call (tokenizers with an `[ARGS]` token, v11 on), else the
    older `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; no end marker (the calls run to the output's
    end)."""
    r = _Rules(fmt)
    if "[ARGS]" not in fmt.special_ids:
        for i, tool in enumerate(tools):
            r.add(f"call_{i}", f"%json {json.dumps(_named_call_schema(tool))}")
        body = " | ".join(f"call_{i}" for i in range(len(tools)))
        r.add("one", f"({body})")
        return r.done(f'{r.m(fmt.start)} "[" {_many("one", parallel, r.m(", "))} "]"', "call")
    alts = [f'{r.m(t.name)} {r.m("[ARGS]")} {r.json(f"args_{i}", t.parameters)}' for i, t in enumerate(tools)]
    r.add("one", " | ".join(f"({a})" for a in alts))
    return r.done(f"{r.m(fmt.start)} one", _many("call", parallel))


def kimi_k2(fmt, tools, parallel):
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
    <|tool_call_end|>...<|tool_calls_section_end|>`: the calls of a turn in one section."""
    r = _Rules(fmt)
    alts = [f'{r.m(f"functions.{t.name}:")} /[0-9]{{1,2}}/ {r.m("<|tool_call_argument_begin|>")} '
            f'{r.json(f"args_{i}", t.parameters)}' for i, t in enumerate(tools)]
    r.add("one", f'{r.m("<|tool_call_begin|>")} ({" | ".join(alts)}) {r.m("<|tool_call_end|>")}')
    return r.done(f"{r.m(fmt.start)} {_many('one', parallel)} {r.m(fmt.end)}", "call")


def kimi_k3(fmt, tools, parallel):
    """`<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|><|open|>json type="object"<|sep|>{...}
    <|close|>json<|sep|><|close|>call<|sep|>...<|close|>tools<|sep|>` (the arguments as one JSON block)."""
    r = _Rules(fmt)
    alts = [f'{r.m(f"call tool={json.dumps(t.name)} index=")} /"[1-9][0-9]?"/ {r.m("<|sep|>")} '
            f'{r.m("<|open|>json type=" + chr(34) + "object" + chr(34) + "<|sep|>")} {r.json(f"args_{i}", t.parameters)} '
            f'{r.m("<|close|>json<|sep|>")}' for i, t in enumerate(tools)]
    r.add("one", f'{r.m("<|open|>")} ({" | ".join(alts)}) {r.m("<|close|>call<|sep|>")}')
    return r.done(f"{r.m(fmt.start)} {_many('one', parallel)} {r.m(fmt.end)}", "call")


def pythonic(fmt, tools, parallel):
    """`<|tool_call_start|>[name(key="text", n=5)]<|tool_call_end|>` (LFM2): keyword values as JSON, which the
    parser reads as Python literals (true, false and null included)."""
    r = _Rules(fmt)
    alts = []
    for i, t in enumerate(tools):
        props, required, defs = _properties(t, "pythonic")
        items = [(f'{r.m(key + "=")} {r.json(f"v_{i}_{j}", sub, defs)}', key in required)
                 for j, (key, sub) in enumerate(props.items())]
        alts.append(f'{r.m(t.name + "(")} {_sequence(r, f"kw_{i}", items, r.m(", "))} ")"')
    r.add("one", " | ".join(f"({a})" for a in alts))
    return r.done(f'{r.m(fmt.start)} "[" {_many("one", parallel, r.m(", "))} "]" {r.m(fmt.end)}', "call")


def muse_spark(fmt, tools, parallel):
    """`<atem:function_calls><atem:invoke name="NAME"><atem:parameter name="k">VALUE</atem:parameter>...
    </atem:invoke></atem:function_calls>`: each value JSON (the parser reads it with json.loads)."""
    r = _Rules(fmt)
    alts = []
    for i, t in enumerate(tools):
        props, required, defs = _properties(t, "muse_spark")
        items = [(f'{r.m(f"<atem:parameter name={json.dumps(key)}>")} {r.json(f"v_{i}_{j}", sub, defs)} '
                  f'"</atem:parameter>"', key in required) for j, (key, sub) in enumerate(props.items())]
        alts.append(f'{r.m(f"<atem:invoke name={json.dumps(t.name)}>")} {_sequence(r, f"p_{i}", items)} '
                    f'"</atem:invoke>"')
    r.add("one", " | ".join(f"({a})" for a in alts))
    return r.done(f"{r.m(fmt.start)} {_many('one', parallel)} {r.m(fmt.end)}", "call")


# --- one value per parameter ----------------------------------------------------------------------------

def _tagged(fmt, tools, parallel, *, head: Callable[[str], str], param: Callable[[str], tuple[str, str]], tail: str,
            strip: bool, excluded: str, name: str, sep: str = "", group: bool = False,
            empty: Callable[[str], str] | None = None) -> CallGrammar:
    """A call as `head(NAME)`, then per parameter `open` VALUE `close` (param(key)), then `tail`; strings raw."""
    r = _Rules(fmt)
    alts = []
    for i, t in enumerate(tools):
        props, required, defs = _properties(t, name)
        if not props and empty is not None:
            alts.append(empty(t.name))
            continue
        items = []
        for j, (key, sub) in enumerate(props.items()):
            opening, closing = param(key)
            value = _value(r, f"v_{i}_{j}", sub, defs, strip, excluded, name)
            items.append((f"{r.m(opening)} {value} {r.m(closing)}", key in required))
        alts.append(f"{r.m(head(t.name))} {_sequence(r, f'p_{i}', items)} {r.m(tail) if tail else ''}")
    r.add("one", " | ".join(f"({a})" for a in alts))
    if group:  # the calls of a turn inside one opening and closing marker
        return r.done(f"{r.m(fmt.start)} {_many('one', parallel)} {r.m(fmt.end)}", "call")
    return r.done(f"{r.m(fmt.start)} one {r.m(fmt.end)}", _many("call", parallel, r.m(sep) if sep else ""))


def qwen3_coder(fmt, tools, parallel):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`."""
    return _tagged(fmt, tools, parallel, head=lambda n: f"\n<function={n}>\n",
                   param=lambda k: (f"<parameter={k}>\n", "\n</parameter>\n"), tail="</function>\n",
                   strip=False, excluded="<", name="qwen3_coder", sep="\n")


def glm47(fmt, tools, parallel):
    """`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>` (GLM 4.7, Laguna)."""
    return _tagged(fmt, tools, parallel, head=lambda n: n, param=lambda k: (f"<arg_key>{k}</arg_key><arg_value>",
                                                                           "</arg_value>"),
                   tail="", strip=True, excluded="<", name="glm47", sep="\n")


def longcat(fmt, tools, parallel):
    """`<longcat_tool_call>NAME<longcat_arg_key>KEY</longcat_arg_key><longcat_arg_value>VALUE
    </longcat_arg_value>...</longcat_tool_call>`; a call without arguments as the JSON form the parser reads."""
    return _tagged(fmt, tools, parallel, head=lambda n: n,
                   param=lambda k: (f"<longcat_arg_key>{k}</longcat_arg_key><longcat_arg_value>",
                                    "</longcat_arg_value>"),
                   tail="", strip=True, excluded="<", name="longcat", sep="\n",
                   empty=lambda n: _lit(json.dumps({"name": n, "arguments": {}})))


def minimax_m2(fmt, tools, parallel):
    """`<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n</invoke>\\n
    </minimax:tool_call>`: a turn's calls in one block."""
    return _tagged(fmt, tools, parallel, head=lambda n: f"\n<invoke name={json.dumps(n)}>\n",
                   param=lambda k: (f"<parameter name={json.dumps(k)}>", "</parameter>\n"), tail="</invoke>",
                   strip=True, excluded="<", name="minimax_m2", group=True)


def minicpm5(fmt, tools, parallel):
    """`<function name="NAME"><param name="KEY">VALUE</param></function>` (MiniCPM 5, no outer wrapper);
    string values without '<', '&' or newlines (which it would wrap in CDATA)."""
    return _tagged(fmt, tools, parallel, head=lambda n: json.dumps(n) + ">",
                   param=lambda k: (f"<param name={json.dumps(k)}>", "</param>"), tail="", strip=True,
                   excluded="<&\\n", name="minicpm5", sep="\n")


def function_gemma(fmt, tools, parallel):
    """`<start_function_call>call:NAME{key:<escape>text<escape>,n:5}<end_function_call>` (FunctionGemma): the
    parser splits at ':' and ',' and ends at the first '}', so values are scalars (objects and arrays are
    refused) and strings exclude '<', '{' and '}'."""
    r = _Rules(fmt)
    esc = r.m("<escape>")
    alts = []
    for i, t in enumerate(tools):
        props, required, defs = _properties(t, "function_gemma")
        items = []
        for j, (key, sub) in enumerate(props.items()):
            if _is_text(sub):
                value = f"{esc} {_text(r, f'v_{i}_{j}', sub, False, FUNCTION_GEMMA_EXCLUDED, 'function_gemma')} {esc}"
            elif isinstance(sub, dict) and sub.get("type") in ("integer", "number", "boolean"):
                value = r.json(f"v_{i}_{j}", sub, defs)
            else:
                raise ConstraintError("tools", f"tools: {t.name}.{key}: the function_gemma tool format holds only "
                                               "strings, numbers and booleans; use tool_choice auto")
            items.append((f"{r.m(key + ':')} {value}", key in required))
        alts.append(f'{r.m("call:" + t.name + "{")} {_sequence(r, f"p_{i}", items, r.m(","))} "}}"')
    r.add("one", " | ".join(f"({a})" for a in alts))
    return r.done(f"{r.m(fmt.start)} one {r.m(fmt.end)}", _many("call", parallel))


def _properties(tool: Tool, name: str) -> tuple[dict, set, dict]:
    schema = tool.parameters
    props = schema.get("properties") or {}
    if any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "patternProperties")) or \
            not isinstance(props, dict) or not all(isinstance(k, str) and re.fullmatch(r"[\w-]+", k) for k in props):
        raise ConstraintError("tools", f"tools: {tool.name}: the {name} tool format writes one argument per listed "
                                       "property (names of letters, digits, '_' or '-'); this schema cannot be "
                                       "forced in it; use tool_choice auto")
    return props, set(schema.get("required") or ()), _defs(schema)


def _is_text(schema) -> bool:
    """A raw-text value: a string schema, or an enum or constant of strings."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return "type" not in schema and isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


def _value(r: _Rules, rule: str, schema, defs: dict, strip: bool, excluded: str, name: str) -> str:
    if _is_text(schema):
        return _text(r, rule, schema, strip, excluded, name)
    if isinstance(schema, dict) and schema.get("type") in JSON_TYPES:
        return r.json(rule, schema, defs)
    raise ConstraintError("tools", f"tools: the {name} tool format converts each argument by its schema's type: "
                                   "give each property a single type (string, integer, number, boolean, object or "
                                   "array) or an enum of strings, or use tool_choice auto")


def _text(r: _Rules, rule: str, schema: dict, strip: bool, excluded: str, name: str) -> str:
    unknown = set(schema) - TEXT_KEYS - ANNOTATIONS
    if unknown:
        raise ConstraintError("tools", f"tools: the {name} tool format writes strings raw and cannot enforce "
                                       f"{sorted(unknown)} on them; remove them or use tool_choice auto")
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise ConstraintError("tools", f"tools: the {name} tool format takes enums of strings only")
        bad = [v for v in values if any(c in v for c in excluded.replace("\\n", "\n")) or (strip and v != v.strip())]
        if bad:
            raise ConstraintError("tools", f"tools: the {name} tool format cannot write the enum value {bad[0]!r}")
        return r.add(rule, " | ".join(_lit(v) for v in values))
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)) \
            or max(lo, hi or 0) > MAX_TEXT:
        raise ConstraintError("tools", f"minLength and maxLength must be integers, 0 <= minLength <= maxLength <= "
                                       f"{MAX_TEXT}")
    c, e = f"[^{excluded}]", f"[^{excluded}\\s]"
    top = "" if hi is None else hi
    if not strip:
        return r.add(rule, f"/{c}{{{lo},{top}}}/")
    alts = [""] if lo == 0 else []  # the parser strips a value: none begins or ends with whitespace
    if lo <= 1 and (hi is None or hi >= 1):
        alts.append(e)
    if hi is None or hi >= 2:
        alts.append(f"{e}{c}{{{max(lo - 2, 0)},{'' if hi is None else hi - 2}}}{e}")
    return r.add(rule, f"/({'|'.join(alts)})/")


def _sequence(r: _Rules, prefix: str, items: list[tuple[str, bool]], sep: str = "") -> str:
    """The items in order, each optional one possibly left out, `sep` between those written."""
    if not items:
        return ""
    rest: dict[tuple[int, bool], str | None] = {}  # the items from i on; `first`: nothing written before them
    for i in range(len(items), -1, -1):
        for first in (True, False):
            if i == len(items):
                rest[i, first] = None
                continue
            text, needed = items[i]
            tail = rest[i + 1, False]
            here = ("" if first or not sep else f"{sep} ") + text + (f" {tail}" if tail else "")
            skip = None if needed else rest[i + 1, first]
            body = here if needed else (f"({here}) | {skip}" if skip else f"({here})?")
            rest[i, first] = r.add(f"{prefix}_{i}_{int(first)}", body)
    return rest[0, True]


GRAMMARS: dict[str, Callable[[Markers, tuple[Tool, ...], bool], CallGrammar]] = {
    "generic": json_tools, "json_tools": json_tools, "mistral": mistral, "kimi_k2": kimi_k2, "kimi_k3": kimi_k3,
    "pythonic": pythonic, "muse_spark": muse_spark, "qwen3_coder": qwen3_coder, "glm47": glm47, "laguna": glm47,
    "longcat": longcat, "minimax_m2": minimax_m2, "minicpm5": minicpm5, "function_gemma": function_gemma,
}
