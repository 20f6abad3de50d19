"""What speculation costs on this machine, measured once per pair and machine on a thread of its own while the pair
serves (models.spec_profiles keeps it; a node that stops meanwhile ends it at its next step).

It times the node's own decode steps on a built-in prompt, wall-clock, every overhead included:
- a plain decode step of one row;
- a speculative round of one row with each k = 1 .. k_max;
- with ROWS rows decoding together: a plain step, and a round at k = 1 and k = k_max (a line between),
  which tells how a step's time grows with the batch on this hardware.

Each kind of step keeps its own caches, and the kinds take turns: one step of each per rotation, the
ratio of each to the plain step of the same rotation kept, and the median of those. On a shared machine a
forward's time drifts by tens of percent within seconds; steps a second apart see the same machine, so
the ratios (all auto needs) hold while the absolute times move. Timed one after another, a drift between
two k's read as a difference between them, and auto picked its k from that.

The one-row greedy rounds also give a first acceptance rate, and a sampled run at temperature 1 gives
another. `speculation.choose_k` turns these into auto's k for the acceptance seen. Serving keeps that
acceptance current (`SpecProfile.observe`), so the k follows the traffic without measuring again.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from typing import Callable

import mlx.core as mx

from ..jobs import SamplingParams
from ..models.loader import LoadedModel
from ..speculation import GREEDY, SPECULATIVE_SAMPLING, MeasurementStopped, SpecCosts, SpecProfile
from .acceptance import SampledChoice, greedy_tokens
from .proposers import drafter_for
from .kv_quant import caches_for
from .spec_rounds import Speculator, merged, prefill, speculative_tokens
from ..telemetry import SpecTelemetry

TEXT = ("A provider node serves language models to a network. It loads a model when a job asks for it, keeps "
        "it while it is used, and evicts it when memory is needed. Speculative decoding drafts a few tokens "
        "with a small model and verifies them with the large one in a single forward pass.")
CONTEXT_TOKENS = 24  # under the smallest sliding window, so every cache kind behaves alike
RUN_TOKENS = 10  # of the sampled run
K_MAX = 4
ROWS = 4  # the batch of the second measurement
REPS = 16  # timed rotations of the one-row kinds: auto's k hangs on differences of a few percent between them
ROWS_REPS = 6  # of the batch's kinds
# How a step is timed: part of a kept profile's key (models.profile_store), so a change here measures again.
SETTINGS = {"k_max": K_MAX, "rows": ROWS, "context_tokens": CONTEXT_TOKENS, "reps": REPS, "rows_reps": ROWS_REPS,
            "run_tokens": RUN_TOKENS}


def _prompt(lm: LoadedModel) -> list[int]:
    ids = lm.tokenizer.encode(TEXT)
    while len(ids) < CONTEXT_TOKENS:
        ids = ids + ids
    return ids[:CONTEXT_TOKENS]


def _read(lm: LoadedModel, prompt: list[int]) -> list:
    """Fresh caches (of the model's KV precision) holding the prompt's K/V but its last token's."""
    caches = caches_for(lm)
    prefill(lm.model, caches, prompt[:-1], len(prompt))
    return caches


def _plain_step(lm: LoadedModel, prompt: list[int], rows: int):
    """A plain kind of step: each call is one greedy step of `rows` rows."""
    model = lm.model
    caches, x = merged([_read(lm, prompt)] * rows), mx.array([prompt[-1:]] * rows)

    def step():
        nonlocal x
        x = greedy_tokens(model(x, cache=caches)[:, -1, :])[:, None]
        mx.eval(x)
    return step


def _round_step(lm: LoadedModel, prompt: list[int], rows: int, k: int, stats: SpecTelemetry):
    """A speculating kind of step: each call is one greedy round of `rows` rows with k drafts; the first
    row's counts go to `stats`."""
    spec, read = Speculator(lm.model, drafter_for(lm), lambda: caches_for(lm)), _read(lm, prompt)
    batch = [spec.new_row(prompt, stats=stats if i == 0 else SpecTelemetry(lm.drafter_mode, k=k), caches=read,
                          cached=len(prompt) - 1) for i in range(rows)]
    spec.begin(batch)
    return lambda: spec.round(batch)


def _take_turns(kinds: list, reps: int, stopping: Callable[[], bool] = lambda: False) -> list[float]:
    """Each kind's step time, taking turns: `reps` rotations, one step of each kind per rotation, after one
    untimed (new kernel shapes), each rotation starting one further along. A kind's time is the median over
    rotations of its ratio to the first kind's step in the same rotation, times the first kind's median:
    steps a second apart see the same machine, so the ratios hold while the machine drifts."""
    times = [[] for _ in kinds]
    for rep in range(reps + 1):
        for j in range(len(kinds)):
            if stopping():
                raise MeasurementStopped
            i = (j + rep) % len(kinds)
            t0 = time.perf_counter()
            kinds[i]()
            if rep:
                times[i].append(time.perf_counter() - t0)
    first = times[0]
    return [statistics.median(first) * statistics.median(t / f for t, f in zip(ts, first)) for ts in times]


def _sampled_acceptance(lm: LoadedModel, prompt: list[int]) -> float:
    stats = SpecTelemetry(lm.drafter_mode, k=2)
    choice = SampledChoice(SamplingParams(RUN_TOKENS, temperature=1.0), seed=0)
    tokens = speculative_tokens(lm.model, prompt, drafter_for(lm), k=2, stats=stats, choice=choice,
                                new_caches=lambda: caches_for(lm))
    for _ in itertools.islice(tokens, RUN_TOKENS):
        pass
    tokens.close()
    return stats.accepted / stats.judged if stats.judged else 0.0


def measure(lm: LoadedModel, k_max: int = K_MAX, stopping: Callable[[], bool] = lambda: False) -> SpecProfile:
    """The pair's costs and first acceptance rates (greedy, and sampled at temperature 1). Raises
    MeasurementStopped, between two steps, once `stopping()`."""
    prompt = _prompt(lm)
    ks = range(1, k_max + 1)
    one_row = [SpecTelemetry(lm.drafter_mode, k=k) for k in ks]
    plain_step = _plain_step(lm, prompt, 1)
    kinds = [plain_step, *(_round_step(lm, prompt, 1, k, s) for k, s in zip(ks, one_row))]
    plain, *rounds = _take_turns(kinds, REPS, stopping)
    # The batch's kinds against the same one-row step, in fewer rotations: auto's batch decisions are far
    # from break-even on either kind of hardware.
    many = [plain_step, _plain_step(lm, prompt, ROWS),
            *(_round_step(lm, prompt, ROWS, k, SpecTelemetry(lm.drafter_mode, k=k)) for k in (1, k_max))]
    plain_again, plain_rows, *ends = _take_turns(many, ROWS_REPS, stopping)
    plain_rows, *ends = (t * plain / plain_again for t in (plain_rows, *ends))  # on the first measurement's scale
    slope = (ends[1] - ends[0]) / max(1, k_max - 1)
    rounds_rows = tuple(ends[0] + slope * (k - 1) for k in ks)
    if stopping():
        raise MeasurementStopped
    judged = sum(s.judged for s in one_row)
    rate = {GREEDY: sum(s.accepted for s in one_row) / judged if judged else 0.0,
            SPECULATIVE_SAMPLING: _sampled_acceptance(lm, prompt)}
    return SpecProfile(SpecCosts(plain, tuple(rounds), ROWS, plain_rows, rounds_rows), rate)


class Profiler:
    """What the residency measures a loaded pair with (`models.profiler`): `measure`, and how it times a step
    (`settings`, part of a kept profile's key), so the residency below the engine never imports it."""

    settings = SETTINGS

    def __init__(self):
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Its node is stopping: a measurement under way ends at its next step (MeasurementStopped)."""
        self._stopping.set()

    def __call__(self, lm: LoadedModel) -> SpecProfile:
        return measure(lm, stopping=self._stopping.is_set)
