"""Grammar-constrained decoding with llguidance: a job's output rules as one Lark grammar, compiled off the
engine thread within bounds, and a matcher per row whose token mask is applied to that row's logits.

- Plain rows: `GrammarProcessor` is the row's last logits processor in mlx-lm's batched step. It consumes the
  tokens sampled since its last call (the step's context), then masks the logits with what the grammar allows
  next. Reading the sampled token back costs the row mlx-lm's step overlap (the mask needs it).
- Speculating rows: each draft position is masked with the grammar's state after the drafts before it, and the
  target's k+1 positions with those same masks plus the one after the last draft. p and q are both the masked,
  renormalised distributions, so sampled speculation stays exact; rejected drafts are rolled back.

The mask is applied with plain mx ops (llguidance's MLX helper is a Metal kernel). Columns the mask does not
cover (a padded vocabulary) are never allowed; the model's end-of-turn ids are the grammar's EOS, allowed only
where the grammar may end.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time

import llguidance
import llguidance.hf
import llguidance.numpy as lln
import mlx.core as mx
import numpy as np

from ..constraints import ConstraintError, OutputRules, closed
from ..types import Cause, JobError
from ..models.tool_format import JSON_CALL_SEPARATORS, ToolFormat

COMPILE_TIMEOUT_S = 2.0  # a grammar that takes longer is refused (it still ends within llguidance's fuel)
MAX_GRAMMAR_CHARS = 1 << 20
TEXT = "TEXT: /(.|\\n)+/"


def lark_for(rules: OutputRules, fmt: ToolFormat | None) -> str:
    """One Lark grammar for the job's output: JSON content, forced calls, or text (or JSON) with calls allowed."""
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
    many = f"call ({calls.separator} call)*" if calls.separator else "call+"
    # A named choice is one call of that function (as vLLM forces it); `required` and `auto` may make several.
    calls_rule = many if rules.parallel_tool_calls and rules.tool_choice.mode != "function" else "call"
    if rules.tool_choice.forced:
        lines.append(f"start: {calls_rule}")
    elif content:
        lines.append(f"start: content | {calls_rule}")
    else:  # free text, and a call may begin anywhere in it; once begun, it is held to the grammar
        if calls.special_trigger:
            lines.append(f"seg: TEXT? {calls.trigger} {calls.body}")
        else:
            lines += [f"trig[lazy]: TEXT? {calls.trigger}", f"seg: trig {calls.body}"]
        lines += [f"start: {'seg*' if rules.parallel_tool_calls else 'seg?'} TEXT?", TEXT]
    return "\n".join(lines)


class Compiler:
    """Compiles grammars for one model, off the engine thread, each within a time and size bound."""

    def __init__(self, tokenizer, n_vocab: int):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=n_vocab,
                                                      eos_token=sorted(tokenizer.eos_token_ids))
        self.n_vocab = n_vocab
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar", initializer=_background)

    def matcher(self, lark: str, param: str):
        """A fresh LLMatcher for `lark`, or ConstraintError naming `param` (too large, too slow, invalid)."""
        if len(lark) > MAX_GRAMMAR_CHARS:
            raise ConstraintError(param, f"{param}: the grammar it needs is over {MAX_GRAMMAR_CHARS} characters")
        # Each step is bounded too, on the engine thread where every row waits for it: lexer fuel and Earley
        # items per step (10,000: about 10 ms at worst here; real schemas use hundreds), so a hostile grammar
        # that compiles costs the batch it shares little before it stops.
        limits = llguidance.LLParserLimits(max_grammar_size=200_000, initial_lexer_fuel=2_000_000,
                                           step_lexer_fuel=200_000, step_max_items=10_000, max_lexer_states=100_000,
                                           verbose_errors=False)
        future = self._pool.submit(_compile_and_step, self.tokenizer, lark, limits)
        try:
            m = future.result(timeout=COMPILE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise ConstraintError(param, f"{param}: the schema took over {COMPILE_TIMEOUT_S:g} s to compile; "
                                         "simplify it") from None
        if m.is_error():
            raise ConstraintError(param, f"{param}: {_first_line(m.get_error())}")
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
    m = llguidance.LLMatcher(tokenizer, lark, log_level=0, limits=limits)
    if not m.is_error():
        m.compute_bitmask()
    return m


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0][:400] if error.strip() else "the grammar did not compile"


class RowGrammar:
    """One row's matcher and its masks; engine thread only."""

    def __init__(self, matcher, n_vocab: int, width: int, end_ids: set[int], kind: str):
        self.matcher = matcher
        self.kind = kind
        self.width = width  # the logits' width
        self.end_ids = end_ids
        self._bits = lln.allocate_token_bitmask(1, n_vocab)
        self._ends = np.zeros(width, dtype=bool)
        self._ends[[t for t in end_ids if t < width]] = True
        self.mask_s = 0.0
        self.masks = 0
        self._round: list[np.ndarray] = []  # a speculative round's masks, position by position
        self._tentative = 0  # drafts consumed in this round, to roll back
        self.steered: list[mx.array] = []  # per draft: the drafter's own top choice was forbidden
        # Set when the matcher stops (a bound reached mid-generation). Nothing here raises into a step other
        # rows share: the row's masks allow everything from then on, and its batch fails it alone (`check`).
        self.error: GrammarError | None = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _fail(self, fallback: str) -> None:
        if self.error is None:
            self.error = GrammarError(_first_line(self.matcher.get_error() or fallback), self.kind)

    # --- one position -----------------------------------------------------------

    def allowed(self) -> np.ndarray:
        """What the grammar allows next, as booleans over the logits' columns."""
        t0 = time.perf_counter()
        if self.error is not None:
            out = np.ones(self.width, dtype=bool)
        elif self.matcher.is_stopped():
            out = self._ends  # a finished grammar allows only its end
        else:
            lln.fill_next_token_bitmask(self.matcher, self._bits, 0)
            bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
            out = np.zeros(self.width, dtype=bool)
            n = min(self.width, bits.size)
            out[:n] = bits[:n]
            if not out.any():
                self._fail("its grammar allows no token here")
                out[:] = True
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return out

    def mask(self, logits: mx.array, allowed: np.ndarray | None = None) -> mx.array:
        return masked(logits, mx.array(self.allowed() if allowed is None else allowed))

    def consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if t in self.end_ids or self.error is not None:
                return  # the row ends here
            if not self.matcher.consume_token(t):
                self._fail(f"token {t} left the grammar")

    # --- a speculative round ------------------------------------------------------

    def draft(self, logits: mx.array) -> mx.array:
        """The drafter's logits at the next draft position, masked; the mask is kept for the verify."""
        allowed = self.allowed()
        self._round.append(allowed)
        self.steered.append(mx.logical_not(mx.array(allowed)[mx.argmax(logits, axis=-1)]))
        return self.mask(logits, allowed)

    def drafted(self, token: int) -> None:
        """Consume a draft tentatively (the next draft's mask depends on it)."""
        if token not in self.end_ids and self.error is None and not self.matcher.is_stopped():
            if not self.matcher.consume_token(token):
                self._fail(f"draft {token} left the grammar")
                return
            self._tentative += 1

    def verify_masks(self) -> mx.array:
        """[k+1, V]: the masks the drafts were drawn under, and the one after the last draft (the bonus's)."""
        masks = mx.array(np.stack(self._round + [self.allowed()]))
        self._round = []
        return masks

    def settle(self, tokens: list[int]) -> None:
        """Undo the round's drafts and take what it kept: its accepted drafts and the target's token."""
        if self._tentative and self.error is None:
            self.matcher.rollback(self._tentative)
        self._tentative = 0
        self.consume(tokens)


class GrammarError(JobError):
    """The matcher stopped mid-generation: its grammar needed more than its bounds allow at some step (the
    request's schema is at fault, so the job ends with INVALID_REQUEST naming it). The row fails alone."""

    def __init__(self, message: str, kind: str = ""):
        param = "tools" if kind.startswith("tool") else "response_format"
        super().__init__(Cause.INVALID_REQUEST, f"{param}: generation stopped: {message}", param)


class GrammarProcessor:
    """A plain row's last logits processor: catch up on the tokens sampled so far, then mask."""

    def __init__(self, grammar: RowGrammar, prompt_len: int):
        self.grammar = grammar
        self._seen = prompt_len  # context tokens the matcher has accounted for

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        n = context.shape[-1] - self._seen
        if n > 0:
            self.grammar.consume(context[-n:].tolist())
            self._seen += n
        masked_logits = self.grammar.mask(logits)
        self.grammar.check()  # a stopped grammar fails this row (the batch's guard), not the step
        return masked_logits


def masked(logits: mx.array, masks: mx.array) -> mx.array:
    """Logits under a mask of the same width ([V], or per position [k+1, V]): what it forbids is -inf."""
    return mx.where(masks, logits, mx.array(-mx.inf, dtype=logits.dtype))
