"""How a model calls tools: the markers around a call, how tools and past calls enter its prompt, how a call's
text is parsed, and the Lark grammar of a call (for llguidance) when a call is forced or has begun.

A chat template with a tool format of its own (mlx-lm infers it: Gemma 4's `<|tool_call>`, the
`<tool_call>`+JSON of Qwen and Hermes, ...) renders the tools itself and mlx-lm's parser for it reads the
calls back. A template with none gets the generic format, the same `<tool_call>` JSON shape: the tools go
into a system preamble, past calls and results into the turns as text, so tools work with every model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from ..constraints import ConstraintError, OutputRules, Tool, closed
from .gemma4_call_grammar import gemma4_arguments_grammar, gemma4_shared_rules

GEMMA4_QUOTE = '<|"|>'

GENERIC = "generic"
JSON_CALL_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _parse_json_call(text: str, tools: Any = None) -> dict:
    return json.loads(text.strip())


@dataclass(frozen=True)
class ToolFormat:
    name: str  # gemma4 | json_tools | generic | another of mlx-lm's parsers
    start: str  # the text that opens a call
    end: str  # and closes it ("" when a call runs to the end of the output)
    parse: Callable[[str, Any], Any]  # the text between them -> {name, arguments} or a list of them
    native: bool  # the chat template renders tools and calls itself
    special_ids: dict[str, int]  # marker text -> its special token id, where the marker is one token

    @property
    def has_grammar(self) -> bool:
        """Whether a call in this format can be written as a grammar (forced, or completed once begun)."""
        return self.name in (GENERIC, "json_tools", "gemma4")

    # --- the prompt -----------------------------------------------------------------

    def prompt_messages(self, messages: list[dict], rules: OutputRules) -> tuple[list[dict], list[dict] | None]:
        """The messages as the template should see them, and the `tools` argument for the template."""
        offered = rules.calls_tools
        if self.native:
            return [_native_message(m) for m in messages], [t.as_openai() for t in rules.tools] if offered else None
        out = [_generic_message(m) for m in messages]
        if offered:
            preamble = generic_preamble(rules.tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": _joined(preamble, out[0]["content"], "\n\n")}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return _merge_turns(out), None

    # --- the grammar of calls -------------------------------------------------------

    def call_grammar(self, rules: OutputRules) -> "CallGrammar":
        """Lark rules for one call of any tool the rules allow. Raises ConstraintError if this format has none."""
        tools = rules.callable_tools()
        if not self.has_grammar:
            raise ConstraintError("tool_choice", f"this model's tool format ({self.name}) has no grammar here, so "
                                                 "calls cannot be forced or checked; use tool_choice none")
        if self.name == "gemma4":
            return self._gemma4_grammar(tools)
        lines = []
        for i, tool in enumerate(tools):
            arguments = closed(tool.parameters)
            # The call wraps the arguments, so the definitions their $refs point at (#/$defs/...) move to its root.
            hoisted = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
            schema = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False,
                      "x-guidance": {**JSON_CALL_SEPARATORS, "lenient": False}, **hoisted}
            lines.append(f"call_{i}: %json {json.dumps(schema)}")
        body = " | ".join(f"call_{i}" for i in range(len(tools)))
        lines.append(f'call_body: "\\n" ({body}) "\\n" {json.dumps(self.end)}')
        lines.append(f"call: {json.dumps(self.start)} call_body")
        return CallGrammar("\n".join(lines), json.dumps(self.start), "call_body", '"\\n"', special_trigger=False)

    def _gemma4_grammar(self, tools: tuple[Tool, ...]) -> "CallGrammar":
        ids = self.special_ids
        if not {self.start, self.end, GEMMA4_QUOTE} <= set(ids):
            raise ConstraintError("tool_choice", "this model's tokenizer lacks Gemma 4's tool-call tokens, so calls "
                                                 "cannot be forced or checked")
        quote = f"<[{ids[GEMMA4_QUOTE]}]>"
        lines, alts = [gemma4_shared_rules(quote)], []
        for i, tool in enumerate(tools):
            lines.append(gemma4_arguments_grammar(f"args_{i}", tool.parameters, quote))
            alts.append(f'"call:{tool.name}" args_{i}')
        lines.append(f"call_body: ({' | '.join(alts)}) <[{ids[self.end]}]>")
        start = f"<[{ids[self.start]}]>"
        lines.append(f"call: {start} call_body")
        return CallGrammar("\n".join(lines), start, "call_body", "", special_trigger=True)


@dataclass(frozen=True)
class CallGrammar:
    rules: str  # Lark rules defining `call` (the whole call) and `body` (what follows the trigger)
    trigger: str  # the Lark item that opens a call
    body: str
    separator: str  # the Lark item between parallel calls ("" for none)
    special_trigger: bool  # the trigger is one special token (no lazy matching needed)


def tool_format_for(tokenizer) -> ToolFormat:
    """The model's tool format, from its mlx-lm TokenizerWrapper."""
    if tokenizer.has_tool_calling:
        module = tokenizer.tool_parser.__module__.rpartition(".")[2]
        vocab = tokenizer.get_vocab()
        specials = {t: vocab[t] for t in (tokenizer.tool_call_start, tokenizer.tool_call_end, GEMMA4_QUOTE)
                    if t and t in vocab and _is_special(tokenizer, vocab[t])}
        return ToolFormat(module, tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser,
                          True, specials)
    return ToolFormat(GENERIC, "<tool_call>", "</tool_call>", _parse_json_call, False, {})


def _is_special(tokenizer, token_id: int) -> bool:
    added = getattr(tokenizer._tokenizer, "added_tokens_decoder", {}) or {}
    return token_id in added


def generic_preamble(tools: tuple[Tool, ...]) -> str:
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                  ensure_ascii=False) for t in tools)
    return ("You can call these tools (each with a JSON Schema of its arguments):\n" + listed + "\n\n"
            "To call a tool, answer with only this, one block per call:\n"
            '<tool_call>\n{"name": "<tool name>", "arguments": {<its arguments as JSON>}}\n</tool_call>\n'
            "Each result comes back to you in a <tool_response> block.")


def _generic_message(m: dict) -> dict:
    """A past call and a tool's result as plain turns: templates without a tool format take only text."""
    content = m.get("content") or ""
    if m.get("role") == "tool":
        return {"role": "user", "content": _joined(_joined("<tool_response>", content, "\n"), "</tool_response>", "\n")}
    calls = m.get("tool_calls")
    if calls:
        blocks = [f"<tool_call>\n{json.dumps(_call_dict(c), ensure_ascii=False)}\n</tool_call>" for c in calls]
        content = _joined(content, "\n".join(blocks), "\n") if content else "\n".join(blocks)
    return {"role": m["role"], "content": content}


def _merge_turns(messages: list[dict]) -> list[dict]:
    """Adjacent turns of one role joined (a result follows the user's question; many templates insist
    on alternating roles)."""
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"] == "user":
            out[-1] = {"role": "user", "content": _joined(out[-1]["content"], m["content"], "\n")}
        else:
            out.append(m)
    return out


def _joined(a: str | list, b: str | list, sep: str) -> str | list:
    """Two contents as one: strings joined by `sep`; with image parts, a list of parts in order."""
    if isinstance(a, str) and isinstance(b, str):
        return a + sep + b
    parts = [{"type": "text", "text": c} if isinstance(c, str) else c for c in (a, sep, b)]
    return [p for c in parts for p in (c if isinstance(c, list) else [c])]


def _native_message(m: dict) -> dict:
    out = {k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name")}
    if m.get("tool_calls"):  # templates read arguments as a mapping (mlx_lm.server does the same)
        out["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": _call_dict(c)}
                             for c in m["tool_calls"]]
    return out


def _call_dict(call: dict) -> dict:
    fn = call["function"]
    return {"name": fn["name"], "arguments": fn["arguments"] if isinstance(fn["arguments"], dict)
            else json.loads(fn["arguments"] or "{}")}
