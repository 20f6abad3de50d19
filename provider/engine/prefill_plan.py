"""How much prompt a batch reads in one engine step, and whose: a pure decision over token counts.

One token budget per step is shared by the rows that decode (a token each) and the prompts being read
(vLLM's `max_num_batched_tokens`). On a CPU a forward's cost grows with its tokens, so the budget is also the
step's length: the time a decoding stream waits for its next token while others prefill. Prompts are read
first come, first served and each to its end before the next one starts (several at once only when they all
end within the step): of four prompts arriving together, the first then gets its first token after a quarter
of the reading, not after all of it, and nothing is read twice. A prompt whose reading just ended is let out
for its first token before anything new is read, since that reading would delay its token by a whole step.

Measured on this project's 2-core CPU (the bundled Gemma 4 demo, `tools/bench/bench_guidellm.py`, see
docs/benchmarks.md): reading a 512-token prompt in 128-token forwards takes 2.16 s, in one 512-token forward
2.48 s (attention over a longer chunk costs more than the per-forward overhead it saves); so the CPU budget
is 128. On a GPU a forward of a few hundred tokens costs little more than one of a few, so the budget is 512.
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
    """Prompt tokens a step reads: the whole budget alone; beside `decoding` rows, half of it less a token for
    each of them (their stream waits for the step), never less than a quarter (with many rows decoding,
    prompts still move)."""
    if not decoding:
        return budget
    return max(budget // 2 - decoding, budget // 4, 1)


@dataclass(frozen=True)
class PrefillPlan:
    join: int  # queued prompts that start being read this step
    chunk: int  # tokens each prompt being read reads this step, at most


def plan_prefill(reading: list[int], queued: list[int], decoding: int, budget: int) -> PrefillPlan:
    """`reading`: tokens still to read of each prompt being read (0: read, it decodes from this step);
    `queued`: the same for the prompts waiting to be read, in arrival order; `decoding`: rows decoding."""
    tokens = prefill_tokens(budget, decoding)
    active = [left for left in reading if left > 0]
    if active:  # finish what is being read first; the budget is split among those prompts
        return PrefillPlan(0, max(1, tokens // len(active)))
    if len(active) < len(reading):  # a prompt just read: its first token before any new reading
        return PrefillPlan(0, tokens)
    join = 0
    for k in range(1, len(queued) + 1):  # several only when all of them end within this step (padding counted)
        if k > 1 and k * max(queued[:k]) > tokens:
            break
        join = k
    return PrefillPlan(join, tokens // join if join > 1 else tokens)
