"""Grammar-constrained decoding with llguidance: a matcher per row (compiled in grammar_compile.py) whose token
mask is applied to that row's logits.

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

import time

import mlx.core as mx
import numpy as np

from ..types import Cause, JobError
from .grammar_compile import LazyCall, first_line

class RowGrammar:
    """One row's matcher and its masks; engine thread only. Given a LazyCall, the row is free (no mask) until
    its output holds the call's opening marker, held to the call's grammar to its end, then free again (or
    ended, when one call is all it may make)."""

    def __init__(self, matcher, n_vocab: int, width: int, end_ids: set[int], kind: str):
        self._lazy = matcher if isinstance(matcher, LazyCall) else None
        self.matcher = self._lazy.matcher if self._lazy else matcher
        self.kind = kind
        self.width = width  # the logits' width
        self.end_ids = end_ids
        import llguidance.numpy as lln

        self._fill = lln.fill_next_token_bitmask
        self._bits = lln.allocate_token_bitmask(1, n_vocab)
        self._ends = np.zeros(width, dtype=bool)
        self._ends[[t for t in end_ids if t < width]] = True
        self._all = np.ones(width, dtype=bool)
        self.mask_s = 0.0
        self.masks = 0
        self._round: list[np.ndarray] = []  # a speculative round's masks, position by position
        self._snapshot = None  # the row's state before a round's drafts, to roll back to
        self.steered: list[mx.array] = []  # per draft: the drafter's own top choice was forbidden
        # A LazyCall's state: free text (`_window`: its last tokens and their bytes, as long as the marker may
        # still be forming in them), inside a call (`_ids`: the matcher's tokens since its reset), or ended.
        self._free = self._lazy is not None
        self._ended = False
        self._window: list[tuple[int, bytes]] = []
        self._ids: list[int] = []
        self._resets = 0
        # Set when the matcher fails mid-generation. Nothing here raises into a step other rows share: the
        # row's masks allow everything from then on, and its batch fails it alone (`check`).
        self.error: GrammarError | None = None

    @classmethod
    def of(cls, compiled, width: int, end_ids: set[int]) -> "RowGrammar":
        """A row's grammar from the job's compiled one (prompts.CompiledGrammar): a generating row's, and the
        verifier's replaying a claim of that job, alike."""
        return cls(compiled.matcher, compiled.n_vocab, width, end_ids, compiled.kind)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _fail(self, what: str) -> None:
        """The matcher failed: its own error (a bound the request's grammar reached, or llguidance's fault) or
        `what` the node saw (an empty mask, a token the mask allowed and the matcher refused)."""
        if self.error is None:
            own = self.matcher.get_error() if self.matcher.is_error() else ""
            self.error = GrammarError(first_line(own or what), self.kind, request=_bound_reached(own))

    @property
    def free(self) -> bool:
        """No mask applies to the next token (a LazyCall's free text)."""
        return self._free and self.error is None

    # --- one position -----------------------------------------------------------

    def allowed(self) -> np.ndarray:
        """What the grammar allows next, as booleans over the logits' columns."""
        if self.error is not None or self._free:
            return self._all
        t0 = time.perf_counter()
        if self.matcher.is_error():
            self._fail("its matcher failed")
            out = self._all
        elif self._ended or self.matcher.is_stopped():
            out = self._ends  # a finished grammar allows only its end
        else:
            self._fill(self.matcher, self._bits, 0)
            bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
            out = np.zeros(self.width, dtype=bool)
            n = min(self.width, bits.size)
            out[:n] = bits[:n]
            if self.matcher.is_error():  # llguidance then allows only its EOS: never taken for an end
                self._fail("its matcher failed computing a mask")
                out = self._all
            elif not out.any():  # a grammar that compiled and stepped always allows something: ours to answer
                self._fail("the grammar allowed no token the model has (the node's tokenizer and grammar disagree)")
                out = self._all
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return out

    def mask(self, logits: mx.array, allowed: np.ndarray | None = None) -> mx.array:
        if allowed is None and self.free:
            return logits
        return masked(logits, mx.array(self.allowed() if allowed is None else allowed))

    def consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if t in self.end_ids or self.error is not None:
                return  # the row ends here
            self._take(t)

    def _take(self, t: int) -> None:
        if self._free:
            self._take_free(t)
        elif not self._ended:
            if not self.matcher.consume_token(t):
                self._fail(f"token {t}, allowed by its mask, left the grammar")
                return
            self._ids.append(t)
            if self._lazy is not None and self._lazy.again and self.matcher.is_accepting():
                self._call_done()

    def _take_free(self, t: int) -> None:
        """Free text: watch for the opening marker in the bytes (however the model spelled it in tokens);
        once there, the matcher takes the call from the marker on, the marker's text re-read as tokens."""
        lazy = self._lazy
        self._window.append((t, lazy.tokenizer.decode_bytes([t])))
        text = b"".join(b for _, b in self._window)
        at = text.find(lazy.trigger)
        if at < 0:
            while len(self._window) > 1 and sum(len(b) for _, b in self._window[1:]) >= len(lazy.trigger) - 1:
                self._window.pop(0)
            return
        k, offset = 0, 0
        while offset + len(self._window[k][1]) <= at:
            offset += len(self._window[k][1])
            k += 1
        first, tail = self._window[k], self._window[k + 1:]
        ids = [first[0]] if at == offset else list(lazy.tokenizer.tokenize_bytes(first[1][at - offset:]))
        ids += [tok for tok, _ in tail]
        self._window = []
        for i in ids:
            if not self.matcher.consume_token(i):  # a marker the call's grammar cannot take from here (the
                self.matcher.reset()  # model wrote it inside other text): the text stays free, and stays text
                self._ids = []
                return
        self._free, self._ids = False, ids
        if lazy.again and self.matcher.is_accepting():
            self._call_done()

    def _call_done(self) -> None:
        self.matcher.reset()
        self._resets += 1
        self._ids, self._free = [], True

    # --- a speculative round ------------------------------------------------------

    def draft(self, logits: mx.array) -> mx.array:
        """The drafter's logits at the next draft position, masked; the mask is kept for the verify."""
        allowed = self.allowed()
        self._round.append(allowed)
        self.steered.append(mx.logical_not(mx.array(allowed)[mx.argmax(logits, axis=-1)]))
        return self.mask(logits, allowed)

    def drafted(self, token: int) -> None:
        """Consume a draft tentatively (the next draft's mask depends on it)."""
        if token in self.end_ids or self.error is not None:
            return
        if self._snapshot is None:
            self._snapshot = (self._free, self._ended, list(self._window), list(self._ids), self._resets)
        self._take(token)

    def verify_masks(self) -> mx.array:
        """[k+1, V]: the masks the drafts were drawn under, and the one after the last draft (the bonus's)."""
        masks = mx.array(np.stack(self._round + [self.allowed()]))
        self._round = []
        return masks

    def settle(self, tokens: list[int]) -> None:
        """Undo the round's drafts and take what it kept: its accepted drafts and the target's token."""
        snap, self._snapshot = self._snapshot, None
        if snap is not None and self.error is None:
            free, ended, window, ids, resets = snap
            if resets == self._resets:
                if len(self._ids) > len(ids):
                    self.matcher.rollback(len(self._ids) - len(ids))
            else:  # a call ended within the drafts: the matcher was reset since; take the call's tokens again
                self.matcher.reset()
                self.matcher.consume_tokens(ids)
            self._free, self._ended, self._window, self._ids = free, ended, window, ids
        self.consume(tokens)


def _bound_reached(error: str) -> bool:
    """Whether llguidance stopped because the grammar needed more than its bounds (the request's schema is at
    fault) rather than failing on its own."""
    return any(w in error.lower() for w in ("limit", "fuel", "too big", "too many"))


class GrammarError(JobError):
    """The matcher failed mid-generation; the row fails alone. When its grammar needed more than its bounds at
    some step, the request's schema is at fault (INVALID_REQUEST naming it); otherwise the node is (INTERNAL,
    said as such). Never a `stop`: what was generated is not a whole answer."""

    def __init__(self, message: str, kind: str = "", request: bool = True):
        param = "tools" if kind.startswith("tool") else "response_format"
        if request:
            super().__init__(Cause.INVALID_REQUEST, f"{param}: generation stopped: {message}", param)
        else:
            super().__init__(Cause.INTERNAL, f"the node's grammar for {param} failed mid-generation: {message}")


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
