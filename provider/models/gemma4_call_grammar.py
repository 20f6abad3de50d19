"""A JSON schema as Lark rules for the arguments of a Gemma 4 tool call.

Gemma 4 writes arguments as JSON with bare keys and strings between `<|"|>` tokens:
`{city:<|"|>Paris<|"|>,days:3,units:[<|"|>c<|"|>]}`, which mlx-lm's gemma4 parser reads back. llguidance's
JSON compiler knows only JSON, so the schema's shape is written out here: objects with their properties in
order (required ones always, optional ones possibly), arrays with their item counts, enums, constants,
unions, `$ref`s to `$defs` (recursion included). A keyword this format cannot enforce (numeric bounds,
string patterns and lengths, formats) is refused, never ignored.
"""

from __future__ import annotations

import json
import re

from ..constraints import ConstraintError

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "strict"}
SHAPES = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum",
          "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "minLength", "maxLength"}
KEY = re.compile(r"\w+")  # what the gemma4 parser takes as a bare key
MAX_RULES = 4096

ANY_RULES = """\
g4_str: QUOTE G4_TEXT? QUOTE
g4_any: g4_str | G4_NUM | "true" | "false" | "null" | g4_any_arr | g4_any_obj
g4_any_arr: "[" (g4_any ("," g4_any)*)? "]"
g4_any_obj: "{" (G4_KEY ":" g4_any ("," G4_KEY ":" g4_any)*)? "}"
G4_KEY: /[A-Za-z_][A-Za-z0-9_]*/
G4_NUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/
G4_INT: /-?(0|[1-9][0-9]*)/
G4_TEXT: /[^<]+/
"""


def gemma4_shared_rules(quote: str) -> str:
    """The rules every tool's arguments grammar uses (any value, strings, numbers), written once."""
    return ANY_RULES.replace("QUOTE", quote)


def gemma4_arguments_grammar(rule: str, schema: dict, quote: str) -> str:
    """Lark rules whose rule `rule` is the arguments object of `schema`; `quote` is the `<|"|>` token as Lark
    writes a special token (`<[id]>`). String values exclude '<', so no text can spell a delimiter. Uses
    `gemma4_shared_rules`."""
    defs = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    builder = _Builder(rule, quote, defs)
    if schema.get("type", "object") != "object":
        raise ConstraintError("tools", "Gemma 4 tool arguments must be an object schema")
    top = builder.value(schema)
    return "\n".join([f"{rule}: {top}", *builder.lines])


class _Builder:
    def __init__(self, prefix: str, quote: str, defs: dict):
        self.prefix, self.quote, self.defs = prefix, quote, defs
        self.lines: list[str] = []
        self.refs: dict[str, str] = {}

    def _rule(self, body: str, name: str | None = None) -> str:
        if len(self.lines) >= MAX_RULES:
            raise ConstraintError("tools", "a tool's parameters schema is too large for a Gemma 4 call grammar")
        name = name or f"{self.prefix}_r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def value(self, schema) -> str:
        if schema is True or schema == {}:
            return "g4_any"
        if not isinstance(schema, dict):
            raise ConstraintError("tools", "Gemma 4 tool arguments: a schema must be an object")
        unknown = set(schema) - SHAPES - ANNOTATIONS
        if unknown:
            raise ConstraintError("tools", f"Gemma 4 tool arguments cannot enforce {sorted(unknown)}; remove them "
                                           "or use tool_choice auto")
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "const" in schema:
            return self._literal(schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ConstraintError("tools", "enum must be a non-empty array")
            return "(" + " | ".join(self._literal(v) for v in schema["enum"]) + ")"
        for union in ("anyOf", "oneOf"):
            if union in schema:
                options = schema[union]
                if not isinstance(options, list) or not options:
                    raise ConstraintError("tools", f"{union} must be a non-empty array")
                return "(" + " | ".join(self.value(o) for o in options) + ")"
        kinds = schema.get("type")
        if kinds is None:
            return "g4_any"
        if isinstance(kinds, list):
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kinds) + ")"
        return self._typed(kinds, schema)

    def _typed(self, kind: str, schema: dict) -> str:
        if kind == "string":
            return self._string(schema.get("minLength", 0), schema.get("maxLength"))
        if kind == "integer":
            return "G4_INT"
        if kind == "number":
            return "G4_NUM"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self._array(schema)
        if kind == "object":
            return self._object(schema)
        raise ConstraintError("tools", f"unknown JSON schema type {kind!r}")

    def _string(self, lo, hi) -> str:
        if lo == 0 and hi is None:
            return "g4_str"
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)) \
                or max(lo, hi or 0) > 10_000:
            raise ConstraintError("tools", "minLength and maxLength must be integers, 0 <= minLength <= maxLength "
                                           "<= 10000")
        if hi == 0:
            return f"({self.quote} {self.quote})"
        text = f"/[^<]{{{lo},{'' if hi is None else hi}}}/"
        return f"({self.quote} {text} {self.quote})" if lo else f"({self.quote} {text}? {self.quote})"

    def _array(self, schema: dict) -> str:
        item = self.value(schema.get("items", True))
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)) \
                or max(lo, hi or 0) > 1000:
            raise ConstraintError("tools", "minItems and maxItems must be integers, 0 <= minItems <= maxItems <= 1000")
        if hi == 0:
            return '"[" "]"'
        more = f'("," {item})' + (f"{{{max(lo - 1, 0)},{hi - 1}}}" if hi is not None else
                                 (f"{{{lo - 1},}}" if lo > 1 else "*"))
        body = f"{item} {more}"
        return f'"[" {body} "]"' if lo > 0 else f'"[" ({body})? "]"'

    def _object(self, schema: dict) -> str:
        props = schema.get("properties") or {}
        if not isinstance(props, dict) or not all(isinstance(k, str) and KEY.fullmatch(k) for k in props):
            raise ConstraintError("tools", "Gemma 4 tool arguments: property names must be letters, digits or '_'")
        if not props:
            return "g4_any_obj"
        required = set(schema.get("required") or ())
        fields = [(f'"{key}:" {self.value(sub)}', key in required) for key, sub in props.items()]
        rest: dict[tuple[int, bool], str | None] = {}  # the fields from i on; `first`: no leading comma

        for i in range(len(fields), -1, -1):
            for first in (True, False):
                if i == len(fields):
                    rest[i, first] = None
                    continue
                text, needed = fields[i]
                tail = rest[i + 1, False]
                here = ("" if first else '"," ') + text + (f" {tail}" if tail else "")
                skip = None if needed else rest[i + 1, first]
                body = here if needed else (f"({here}) | {skip}" if skip else f"({here})?")
                rest[i, first] = self._rule(body)
        return f'"{{" {rest[0, True]} "}}"'

    def _ref(self, ref) -> str:
        if ref in self.refs:
            return self.refs[ref]
        match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        if not match or match.group(2) not in self.defs:
            raise ConstraintError("tools", f"$ref {ref!r} must name an entry of the schema's $defs")
        name = self.refs[ref] = f"{self.prefix}_d{len(self.refs)}"
        self._rule(self.value(self.defs[match.group(2)]), name)
        return name

    def _literal(self, value) -> str:
        if isinstance(value, str):
            if "<" in value:
                raise ConstraintError("tools", "Gemma 4 tool arguments: string constants cannot contain '<'")
            return f"({self.quote} {json.dumps(value, ensure_ascii=False)} {self.quote})"
        if value is None or isinstance(value, (bool, int, float)):
            return json.dumps(json.dumps(value))
        raise ConstraintError("tools", "Gemma 4 tool arguments: enum and const values must be scalars")
