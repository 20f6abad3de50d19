"""One reader of prompts: a prompt read into a row's caches a chunk per engine step, whoever reads it.

Besides mlx-lm's generator (the plain batch's prompts), three kinds of row read their prompt themselves: a
scored prompt (each chunk's logits become its logprobs: logprobs.PromptScorer), a speculating row (the
drafter's caches fed the same chunk after the target's: spec_rounds.Speculator.read) and a prompt with images
or video (the vision tower's features spliced into its embeddings: vision_prefill.MediaRead). All read the same
way, here: every prompt token but the last (the row's first decode reads it), in chunks by one rule
(prefill_plan.read_chunk, the generator's too), each chunk one forward evaluated with its caches; what differs
is the forward, a hook. What reading holds is booked by one function, `reading_bytes`, for every kind.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from ..memory.batch_kv import prefill_transient_bytes
from .prefill_plan import longest_read, read_chunk

# What scoring a chunk of prompt may hold beyond the forward's own scratch: its logits for every position (a
# plain prefill never computes them), their float32 log-softmax and the top-k indices, about 16 bytes a
# position and vocabulary entry. logprobs.score_chunk cuts a chunk to fit this; the ledger books it while a
# prompt is scored.
SCORE_SCRATCH_BYTES = 64 << 20

PREFILL_ROWS = 8  # prompts the plain batch reads in one forward (mlx-lm's prefill_batch_size)

# (start, end) -> what to evaluate with the caches beside them (a scored chunk's logprobs), or None
Forward = Callable[[int, int], Any]


class PromptReader:
    """`prompt`'s tokens from `read` on, into `cache`, by `forward(start, end)`: a chunk a `step`. `most` caps the
    positions of one forward (a scored chunk's logits must fit their scratch); at `pause_at` a chunk ends and
    `on_pause(cache)` sees the caches (a shared system prefix kept as soon as it is read)."""

    def __init__(self, prompt: list[int], cache: list, forward: Forward, *, read: int = 0, most: int = 0,
                 pause_at: int = 0, on_pause: Callable[[list], None] | None = None):
        self.prompt, self.cache, self.read = prompt, cache, read
        self._forward, self._most = forward, most
        self._pause_at = pause_at if on_pause is not None and read < pause_at else 0
        self._on_pause = on_pause

    @property
    def left(self) -> int:
        """Prompt tokens still to read (the last is the row's first decode's)."""
        return max(0, len(self.prompt) - 1 - self.read)

    @property
    def done(self) -> bool:
        return self.read >= len(self.prompt) - 1

    def chunk(self, budget: int, decoding: int) -> int:
        """This step's tokens by the one rule, for a prompt read beside `decoding` rows in a `budget` step."""
        return read_chunk(self.left, budget, decoding)

    def step(self, tokens: int) -> tuple[int, int]:
        """Read up to `tokens` more (fewer at the pause point or past `most`); the (start, end) read."""
        start = self.read
        end = min(len(self.prompt) - 1, start + max(1, min(tokens, self._most) if self._most else tokens))
        if start < self._pause_at < end:
            end = self._pause_at
        if end <= start:
            return start, start
        extra = self._forward(start, end)
        mx.eval([c.state for c in self.cache], extra if extra is not None else [])
        self.read = end
        if end == self._pause_at:
            self._on_pause(self.cache)
        return start, end


def reading_bytes(lm, plain, spec, budget: int) -> int:
    """What reading prompts holds beyond the model's KV and footprint (which holds one chunk of one row's forward
    scratch): for each prompt being read, a chunk of at most `longest_read(budget)` (up to PREFILL_ROWS in one
    plain forward, one at a time speculating), and what its hook holds beside: a scored chunk's logits
    (SCORE_SCRATCH_BYTES), a media prompt's arrays and embeddings, the vision tower's scratch for the
    largest item left to encode. `plain` and `spec` are batch_layout.Layout's."""
    if lm.act_shape is None:
        return 0
    chunk = longest_read(budget)
    scratch = max(prefill_transient_bytes(plain.reading, lm.act_shape, chunk, PREFILL_ROWS),
                  prefill_transient_bytes(spec.reading, lm.act_shape, chunk, 1))
    return max(0, scratch - lm.act_reserve) + (SCORE_SCRATCH_BYTES if plain.scoring else 0) + plain.media \
        + plain.vision
