"""What speculation costs on this machine, measured once per loaded pair on the loader thread.

Before the pair serves, it runs the node's own decode loops on a built-in prompt and times them wall-clock,
every overhead included:
- plain decoding, per token;
- a speculative round with each k = 1 .. k_max;
- the same with ROWS rows decoding together: a plain step, and a round at k = 1 and k = k_max (a line
  between), which tells how a step's time grows with the batch on this hardware.

The greedy runs also give a first acceptance rate, and a sampled run at temperature 1 gives another.
`speculation.choose_k` turns these into auto's k for the acceptance seen. Serving keeps that acceptance
current (`SpecProfile.observe`), so the k follows the traffic without measuring again.
"""

from __future__ import annotations

import itertools
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from ..jobs import SamplingParams
from ..models.loader import LoadedModel
from ..speculation import GREEDY, SPECULATIVE_SAMPLING, SpecCosts, SpecProfile
from .acceptance import GreedyChoice, SampledChoice, greedy_tokens
from .drafters import drafter_for
from .speculative import SpecStats, Speculator, merged, prefill, speculative_tokens

TEXT = ("A provider node serves language models to a network. It loads a model when a job asks for it, keeps "
        "it while it is used, and evicts it when memory is needed. Speculative decoding drafts a few tokens "
        "with a small model and verifies them with the large one in a single forward pass.")
CONTEXT_TOKENS = 24  # under the smallest sliding window, so every cache kind behaves alike
RUN_TOKENS = 10
PLAIN_TOKENS = 10
K_MAX = 4
ROWS = 4  # the batch of the second measurement
ROWS_STEPS = 3  # timed steps (and rounds) of it, after one untimed


def _prompt(lm: LoadedModel) -> list[int]:
    ids = lm.tokenizer.encode(TEXT)
    while len(ids) < CONTEXT_TOKENS:
        ids = ids + ids
    return ids[:CONTEXT_TOKENS]


def _plain_token_s(model, prompt: list[int]) -> float:
    steps = generate_step(mx.array(prompt), model, max_tokens=PLAIN_TOKENS + 1)
    next(steps)  # the prefill
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    return max(1e-6, (time.perf_counter() - t0) / max(1, n))


def _speculative_run(lm: LoadedModel, prompt: list[int], k: int, choice) -> tuple[SpecStats, float]:
    """Stats of a run and its wall time per round, the first round (new kernel shapes) left out."""
    stats = SpecStats(lm.drafter_mode, k)
    tokens = speculative_tokens(lm.model, prompt, drafter_for(lm), k=k, stats=stats, choice=choice)
    next(tokens)  # the prefill and first token
    while stats.rounds < 1:
        next(tokens)
    first_rounds, t0 = stats.rounds, time.perf_counter()
    for _ in itertools.islice(tokens, RUN_TOKENS):
        pass
    tokens.close()
    return stats, (time.perf_counter() - t0) / max(1, stats.rounds - first_rounds)


def _plain_rows_s(model, prompt: list[int], rows: int) -> float:
    read = make_prompt_cache(model)
    prefill(model, read, prompt[:-1], len(prompt))
    caches, x = merged([read] * rows), mx.array([prompt[-1:]] * rows)
    times = []
    for _ in range(ROWS_STEPS + 1):
        t0 = time.perf_counter()
        x = greedy_tokens(model(x, cache=caches)[:, -1, :])[:, None]
        mx.eval(x)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _round_rows_s(lm: LoadedModel, prompt: list[int], rows: int, k: int) -> float:
    spec, read = Speculator(lm.model, drafter_for(lm)), make_prompt_cache(lm.model)
    prefill(lm.model, read, prompt[:-1], len(prompt))
    batch = [spec.new_row(prompt, stats=SpecStats(lm.drafter_mode, k), caches=read, cached=len(prompt) - 1)
             for _ in range(rows)]
    spec.begin(batch)
    times = []
    for _ in range(ROWS_STEPS + 1):
        t0 = time.perf_counter()
        spec.round(batch)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def measure(lm: LoadedModel, k_max: int = K_MAX) -> SpecProfile:
    """The pair's costs and first acceptance rates (greedy, and sampled at temperature 1)."""
    prompt = _prompt(lm)
    plain = _plain_token_s(lm.model, prompt)
    rounds, accepted, judged = [], 0, 0
    for k in range(1, k_max + 1):
        stats, per_round = _speculative_run(lm, prompt, k, GreedyChoice())
        rounds.append(per_round)
        accepted, judged = accepted + stats.accepted, judged + stats.judged
    sampled, _ = _speculative_run(lm, prompt, 2, SampledChoice(SamplingParams(RUN_TOKENS, temperature=1.0), seed=0))
    rate = {GREEDY: accepted / judged if judged else 0.0,
            SPECULATIVE_SAMPLING: sampled.accepted / sampled.judged if sampled.judged else 0.0}
    plain_rows = _plain_rows_s(lm.model, prompt, ROWS)
    ends = _round_rows_s(lm, prompt, ROWS, 1), _round_rows_s(lm, prompt, ROWS, k_max)
    slope = (ends[1] - ends[0]) / max(1, k_max - 1)
    rounds_rows = tuple(ends[0] + slope * (k - 1) for k in range(1, k_max + 1))
    return SpecProfile(SpecCosts(plain, tuple(rounds), ROWS, plain_rows, rounds_rows), rate)
