"""A job's output rules as one Lark grammar, compiled for llguidance off the engine thread within bounds: an
LLMatcher from the first token, or a `LazyCall` that holds `auto`'s free text to a call's grammar only from the
call's opening marker. What the rows do with them is in grammar.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import threading
import time

from ..constraints import ConstraintError, OutputRules, closed
from ..models.call_grammars import JSON_CALL_SEPARATORS
from ..models.tool_format import ToolFormat
from ..types import Cause, JobError

COMPILE_TIMEOUT_S = 2.0  # a grammar that takes longer to compile is refused (it still ends within its fuel)
COMPILE_QUEUE_S = 30.0  # waiting longer than this behind other compiles is the node's overload
MAX_GRAMMAR_CHARS = 1 << 20
# Each step is bounded too, on the engine thread where every row waits for it: lexer fuel and Earley items per
# step (10,000: about 10 ms at worst here; real schemas use hundreds), so a hostile grammar that compiles costs
# the batch it shares little before it stops.
LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=2_000_000, step_lexer_fuel=200_000,
              step_max_items=10_000, max_lexer_states=100_000, verbose_errors=False)


def lark_for(rules: OutputRules, fmt: ToolFormat | None) -> str:
    """One Lark grammar for the job's output from its first token: JSON content, forced calls, or JSON content
    or calls. (`auto` over free text has no grammar until a call begins: `call_lark`.)"""
    lines = ["%llguidance {}"]
    content = None
    if rules.json_content:
        schema = closed(rules.content_schema())
        schema["x-guidance"] = {**JSON_CALL_SEPARATORS, "lenient": False}  # clients may not set x-guidance
        lines.append(f"content: %json {json.dumps(schema)}")
        content = "content"
    if not rules.calls_tools:
        lines.append("start: content")
        return "\n".join(lines)
    calls = fmt.call_grammar(rules)
    lines.append(calls.rules)
    # A named choice is one call of that function (as vLLM forces it); `required` and `auto` may make several.
    lines.append(f"start: {content} | calls" if content and not rules.tool_choice.forced else "start: calls")
    return "\n".join(lines)


def call_lark(rules: OutputRules, fmt: ToolFormat) -> str:
    """`auto` over free text: the grammar of one call from its opening marker (a `LazyCall` holds to it only
    once the model has written that marker)."""
    # A format without an end marker runs its calls to the output's end: they are all held, then the end.
    return "\n".join(["%llguidance {}", fmt.call_grammar(rules).rules, f"start: {'call' if fmt.end else 'calls'}"])


def compile_rules(compiler: "Compiler", rules: OutputRules, fmt: ToolFormat | None):
    """What holds a job's output to its rules: an LLMatcher from the first token, a LazyCall (`auto` over free
    text, in a format with a call grammar), or None (`auto` in a format without one: calls are only parsed)."""
    param = "tools" if rules.calls_tools else "response_format"
    if rules.calls_tools and not rules.json_content and not rules.tool_choice.forced:
        if fmt is None or not fmt.has_grammar:
            return None
        try:
            lark = call_lark(rules, fmt)
        except ConstraintError:  # a schema this format cannot write: its calls are parsed, not held
            return None
        matcher = compiler.matcher(lark, param)
        return LazyCall(matcher, fmt.start.encode(), compiler.tokenizer,
                        again=bool(fmt.end) and rules.parallel_tool_calls)
    return compiler.matcher(lark_for(rules, fmt), param)


@dataclasses.dataclass(frozen=True)
class LazyCall:
    """`auto` over free text: no mask until the output holds the format's opening marker; from there to the
    call's end, the call's grammar. Free text is free: any token, special ones included (a thinking channel)."""

    matcher: object  # llguidance.LLMatcher of `start: call`, the marker included
    trigger: bytes  # the opening marker's text
    tokenizer: object  # llguidance.LLTokenizer: free tokens' bytes, and the marker re-read as tokens
    again: bool  # after a call, free text again (more calls may follow); else the output ends there


class Compiler:
    """Compiles grammars for one model, off the engine thread, each within a time and size bound."""

    def __init__(self, tokenizer, n_vocab: int, limits: dict | None = None):
        import llguidance.hf  # here, not at start: a node whose jobs have no grammar never loads it

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=n_vocab,
                                                      eos_token=sorted(tokenizer.eos_token_ids))
        self.n_vocab = n_vocab
        self.limits = LIMITS | (limits or {})
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar", initializer=_background)

    def matcher(self, lark: str, param: str):
        """A fresh LLMatcher for `lark`, or ConstraintError naming `param` (too large, too slow, invalid)."""
        if len(lark) > MAX_GRAMMAR_CHARS:
            raise ConstraintError(param, f"{param}: the grammar it needs is over {MAX_GRAMMAR_CHARS} characters")
        started = threading.Event()
        began: list[float] = []

        def compile_():
            import llguidance

            began.append(time.monotonic())
            started.set()
            return _compile_and_step(self.tokenizer, lark, llguidance.LLParserLimits(**self.limits))

        future = self._pool.submit(compile_)
        # The bound is the compile's own time, from its start: time queued behind other jobs' compiles is the
        # node's, not the schema's. A queue that long is the node's fault, said so.
        if not started.wait(COMPILE_QUEUE_S):
            future.cancel()
            raise JobError(Cause.OVERLOADED, f"the node's grammar compiler is busy (this schema waited over "
                                             f"{COMPILE_QUEUE_S:g} s to start); retry")
        try:
            m = future.result(timeout=max(0.0, began[0] + COMPILE_TIMEOUT_S - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise ConstraintError(param, f"{param}: the schema took over {COMPILE_TIMEOUT_S:g} s to compile; "
                                         "simplify it") from None
        if m.is_error():
            raise ConstraintError(param, f"{param}: {first_line(m.get_error())}")
        return m


def _background() -> None:
    """Compiling runs beneath decoding: on a machine of few cores a large grammar's compile (it releases the
    GIL) must not take a core from the engine thread's forward."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only (Linux, macOS)
    except (AttributeError, OSError):
        pass


def _compile_and_step(tokenizer, lark: str, limits):
    """A matcher and its first mask: a grammar that compiles but cannot take a first step within its bounds
    (a recursion it must expand without end, say) is refused here, before the job is admitted."""
    import llguidance

    m = llguidance.LLMatcher(tokenizer, lark, log_level=0, limits=limits)
    if not m.is_error():
        m.compute_bitmask()
    return m


def first_line(error: str) -> str:
    return error.strip().splitlines()[0][:400] if error.strip() else "the grammar did not compile"
