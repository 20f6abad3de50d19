"""How much prompt a batch reads in one engine step, and whose: a pure decision over token counts.

Each step is one decode forward over the decoding rows and one forward over the prompts being read, within
a token budget (vLLM's `max_num_batched_tokens`, adapted: here decode and prefill are separate forwards).
Prompts are read first come, first served, each to its end before the next starts (several in one forward
only when all of them end within the step): of four prompts arriving together the first gets its first
token after a quarter of the reading, not after all of it. A prompt just read is let out for its first token
before anything new is read, which would delay that token by a whole step.

Why these numbers (this project's 2-core CPU, the bundled model; docs/benchmarks.md):
- a prompt forward's cost is linear in its tokens from 16 to 128 (about 3.8 ms a token), and a longer
  chunk costs more a token (512 tokens in one forward 2.48 s, in 128-token forwards 2.16 s): so on a CPU
  the budget is 128, alone and in total; on a GPU, where a forward of a few hundred tokens costs about as
  much as one of a few, it is 512;
- beside decoding rows a step reads half the budget, so a lone stream waits about 0.16 s while a long prompt
  is read (`tools/bench/bench_vs_server.py`: a quarter of mlx_lm.server's wait at prefill step 256), and 4
  more tokens for each decoding row up to the whole budget: every decode forward pays a fixed ~10 ms, and
  with 16 rows decoding fewer, larger reads took 23% fewer steps and 3% more tokens a second.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_STEP_TOKENS = 128
GPU_STEP_TOKENS = 512
MIN_STEP_TOKENS = 16


def step_tokens(configured: int, backend: str) -> int:
    """The per-step token budget: the configured one, or (0) the device's default."""
    if configured:
        return max(MIN_STEP_TOKENS, configured)
    return CPU_STEP_TOKENS if backend == "cpu" else GPU_STEP_TOKENS


def prefill_tokens(budget: int, decoding: int) -> int:
    """Prompt tokens a step reads: the whole budget when nothing decodes; beside decoding rows, half of it,
    and 4 more for each of them up to the whole budget. Half keeps a lone stream's wait short while another
    prompt is read; with many rows decoding, each step's decode forward costs more (a fixed part every
    forward pays), so fewer, larger reads waste less of it."""
    if not decoding:
        return budget
    return min(budget, budget // 2 + 4 * decoding)


@dataclass(frozen=True)
class PrefillPlan:
    join: int  # queued prompts that start being read this step
    chunk: int  # tokens each prompt being read reads this step, at most


def plan_prefill(reading: list[int], queued: list[int], decoding: int, budget: int) -> PrefillPlan:
    """`reading`: tokens still to read of each prompt being read (0: read, it decodes from this step);
    `queued`: the same for the prompts waiting to be read, in arrival order; `decoding`: rows decoding."""
    tokens = prefill_tokens(budget, decoding)
    active = [left for left in reading if left > 0]
    if len(active) == 1:  # finish what is being read first
        return PrefillPlan(0, read_chunk(active[0], budget, decoding))
    if active:  # several, read together because they fit: they share the budget
        return PrefillPlan(0, max(1, tokens // len(active)))
    if len(active) < len(reading):  # a prompt just read: its first token before any new reading
        return PrefillPlan(0, tokens)
    join = 0
    for k in range(1, len(queued) + 1):  # several only when all of them end within this step (padding counted)
        if k > 1 and k * max(queued[:k]) > tokens:
            break
        join = k
    if join == 1:
        return PrefillPlan(1, read_chunk(queued[0], budget, decoding))
    return PrefillPlan(join, tokens // join if join else tokens)


def read_chunk(left: int, budget: int, decoding: int) -> int:
    """The one chunk rule: tokens a prompt read alone reads this step, `left` of it still to read, beside
    `decoding` rows. The plain batch's generator, a scored prompt, a speculating row and a prompt with media
    all read by it (provider.engine.prompt_reader), and the ledger books its largest (`longest_read`)."""
    return _whole_if_nearly(left, prefill_tokens(budget, decoding))


def longest_read(budget: int) -> int:
    """The most prompt tokens of one row a step reads (memory books its scratch for this)."""
    return budget + budget // 4


def _whole_if_nearly(left: int, tokens: int) -> int:
    """A prompt within a quarter over the step's tokens is read whole: a forward of its own for the tail would
    pay the fixed cost of a forward (~10 ms, the cost of ~3 tokens) for a few tokens."""
    return left if left <= tokens + tokens // 4 else tokens
