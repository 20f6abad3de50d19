"""How a model calls tools: the markers around a call, how tools and past calls enter its prompt, how a call's
text is parsed, and the Lark grammar of a call (for llguidance) when a call is forced or has begun.

A chat template with a tool format of its own (mlx-lm infers it: Gemma 4's `<|tool_call>`, the
`<tool_call>`+JSON of Qwen and Hermes, ...) renders the tools itself and mlx-lm's parser for it reads the
calls back. A template with none gets the generic format, the same `<tool_call>` JSON shape: the tools go
into a system preamble, past calls and results into the turns as text, so tools work with every model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..constraints import ConstraintError, OutputRules, Tool
from .call_grammars import GRAMMARS, JSON_CALL_SEPARATORS, CallGrammar
from .gemma4_call_grammar import gemma4_arguments_grammar, gemma4_shared_rules

GEMMA4_QUOTE = '<|"|>'

GENERIC = "generic"
__all__ = ["CallGrammar", "JSON_CALL_SEPARATORS", "ToolFormat", "tool_format_for"]


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

    # --- the prompt -----------------------------------------------------------------

    def prompt_messages(self, messages: list[dict], rules: OutputRules) -> tuple[list[dict], list[dict] | None]:
        """The messages as the template should see them, and the `tools` argument for the template."""
        if self.native:  # under `none` too (as vLLM and OpenAI): the model knows its tools, it is not let call
            return [_native_message(m) for m in messages], [t.as_openai() for t in rules.tools] or None
        out = [_generic_message(m) for m in messages]
        if rules.calls_tools:  # the generic preamble is an invitation to call: not under `none`
            preamble = generic_preamble(rules.tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": _joined(preamble, out[0]["content"], "\n\n")}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return _merge_turns(out), None

    # --- the grammar of calls -------------------------------------------------------

    @property
    def has_grammar(self) -> bool:
        """Whether a call in this format can be written as a grammar (forced, or held once begun)."""
        if self.name == "gemma4":
            return {self.start, self.end, GEMMA4_QUOTE} <= set(self.special_ids)
        return self.name in GRAMMARS

    def marker(self, text: str) -> str:
        """`text` as a Lark item: its special tokens as llguidance writes one (`<[id]>`, matched by that token
        only), the rest as literal text."""
        specials = sorted((t for t in self.special_ids if t in text), key=len, reverse=True)
        if not specials:
            return json.dumps(text, ensure_ascii=False)
        parts = re.split("(" + "|".join(re.escape(t) for t in specials) + ")", text)
        return " ".join(f"<[{self.special_ids[p]}]>" if p in self.special_ids else json.dumps(p, ensure_ascii=False)
                        for p in parts if p)

    def call_grammar(self, rules: OutputRules) -> CallGrammar:
        """Lark rules for a call of any tool the rules allow: `call` (one, from its opening marker) and `calls`
        (what a forced choice writes). Raises ConstraintError if this format has no grammar."""
        if not self.has_grammar:
            raise ConstraintError("tool_choice", f"tool_choice {rules.tool_choice.mode}: this model's tool format "
                                                 f"({self.name}) has no call grammar here, so a call cannot be "
                                                 "forced; use tool_choice auto (its calls are parsed) or none")
        parallel = rules.parallel_tool_calls and rules.tool_choice.mode != "function"
        tools = rules.callable_tools()
        if self.name == "gemma4":
            return self._gemma4_grammar(tools, parallel)
        return GRAMMARS[self.name](self, tools, parallel)

    def _gemma4_grammar(self, tools: tuple[Tool, ...], parallel: bool) -> CallGrammar:
        ids = self.special_ids
        quote = f"<[{ids[GEMMA4_QUOTE]}]>"
        lines, alts = [gemma4_shared_rules(quote)], []
        for i, tool in enumerate(tools):
            lines.append(gemma4_arguments_grammar(f"args_{i}", tool.parameters, quote))
            alts.append(f'"call:{tool.name}" args_{i}')
        lines.append(f"call: <[{ids[self.start]}]> ({' | '.join(alts)}) <[{ids[self.end]}]>")
        lines.append(f"calls: {'call+' if parallel else 'call'}")
        return CallGrammar("\n".join(lines))


def tool_format_for(tokenizer) -> ToolFormat:
    """The model's tool format, from its mlx-lm TokenizerWrapper."""
    if tokenizer.has_tool_calling:
        module = tokenizer.tool_parser.__module__.rpartition(".")[2]
        return ToolFormat(module, tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser,
                          True, _special_tokens(tokenizer))
    return ToolFormat(GENERIC, "<tool_call>", "</tool_call>", _parse_json_call, False, {})


def _special_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens (text -> id): a grammar names a marker that is one by its id (llguidance
    matches special tokens only so; text never spells one)."""
    added = getattr(tokenizer._tokenizer, "added_tokens_decoder", {}) or {}
    return {t.content: i for i, t in added.items() if getattr(t, "special", False)}


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
