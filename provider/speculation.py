"""Speculation decisions, pure: whether a target gets a drafter, and whether each job speculates.

Plain data in, a decision out; no MLX, no I/O. The model residency asks `plan_drafter` when it loads a
target; the engine asks `plan` for every job. `SpeculationConfig` is the one owner of the node's policy
and k, built once from the settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from .types import Policy, SpecMode, SpecReason


class PairingFacts(Protocol):
    """What the files say a target can do with a drafter (provider.models.capability.Capabilities)."""

    mtp_capable: bool
    draft_compatible: bool
    drafter_reason: str


class SamplingFacts(Protocol):
    """What a job's sampling means for speculation (provider.jobs.SamplingParams)."""

    seed: int | None

    @property
    def greedy(self) -> bool: ...

    @property
    def has_logits_processors(self) -> bool: ...

    prompt_logprobs: bool


GREEDY, SPECULATIVE_SAMPLING = "greedy", "speculative_sampling"  # how drafts are judged (engine.acceptance)
PROFIT_MARGIN = 1.05  # auto speculates only when the expected gain clears measurement noise
PROBE_EVERY = 16  # while not profitable, every 16th eligible job speculates anyway, to keep the estimate fresh


@dataclass(frozen=True)
class SpeculationConfig:
    policy: Policy = Policy.AUTO
    k: int = 3  # draft tokens per round
    max_batch: int = 8  # under auto, a job speculates only while its model runs at most this many jobs

    @classmethod
    def of(cls, settings) -> "SpeculationConfig":
        return cls(Policy(settings.speculation), settings.speculation_k, settings.speculation_max_batch)


@dataclass(frozen=True)
class DrafterPlan:
    mode: SpecMode | None  # None: the target serves alone
    reason: SpecReason


def plan_drafter(caps: PairingFacts, policy: Policy, need_bytes: int, free_bytes: int) -> DrafterPlan:
    """In the design's order: the target can use a drafter (decided from config files), the drafter fits
    the headroom left after the target, and the policy is not off."""
    mode = SpecMode.MTP if caps.mtp_capable else SpecMode.DRAFT if caps.draft_compatible else None
    if mode is None:
        # A drafter that was named but does not pair is `no_drafter` (the pairing problem is logged).
        return DrafterPlan(None, SpecReason.NOT_MTP_CAPABLE if caps.drafter_reason == SpecReason.NOT_MTP_CAPABLE
                           else SpecReason.NO_DRAFTER)
    if need_bytes > free_bytes:
        return DrafterPlan(None, SpecReason.INSUFFICIENT_HEADROOM)
    if policy is Policy.OFF:
        return DrafterPlan(None, SpecReason.POLICY_OFF)
    return DrafterPlan(mode, SpecReason.OK)


def plan_group_drafter(plan: DrafterPlan, policy: Policy, reads_only_tokens_and_final_hidden: bool) -> DrafterPlan:
    """A node group's drafter (rank 0 drafts alone; every rank verifies, provider.group.drafts). It may read
    only what rank 0 holds whole, the tokens and the final hidden state (a draft model, a native MTP head), not
    the target's K/V or inner layers, which the group splits (Gemma 4's assistant). And it needs the node's
    policy `on`: `auto` would measure the pair's costs on a thread of its own, whose forwards no other rank
    joins."""
    if plan.mode is None:
        return plan
    if not reads_only_tokens_and_final_hidden or policy is not Policy.ON:
        return DrafterPlan(None, SpecReason.GROUP_MODE)
    return plan


@dataclass(frozen=True)
class SpecCosts:
    """What decoding costs on this machine, measured wall-clock once per loaded pair (provider.engine.profile):
    one row, and again with `rows` rows decoding together. Between and beyond the two, a step's time is taken
    as linear in the rows: near flat where a forward is bound by reading the weights (a GPU), near
    proportional where it is bound by arithmetic (this CPU), and the two measurements say which."""

    plain_token_s: float  # a plain decode step of one row (one token)
    round_s: tuple[float, ...]  # a speculative round of one row with k = 1, 2, ... drafts (index k - 1)
    rows: int = 1  # rows of the second measurement (1: there is none)
    plain_rows_s: float = 0.0  # a plain decode step of `rows` rows
    round_rows_s: tuple[float, ...] = ()  # a speculative round of `rows` rows, k = 1, 2, ...

    @property
    def k_max(self) -> int:
        return len(self.round_s)

    def plain(self, rows: int = 1) -> float:
        return self._in_rows(self.plain_token_s, self.plain_rows_s, rows)

    def round(self, k: int, rows: int = 1) -> float:
        """A round's time with k drafts from a least-squares line through the measured rounds: each draft
        adds a drafter step and a verify column, and the line smooths the noise of a few rounds per k."""
        measured = self._in_rows(_on_line(self.round_s, k), _on_line(self.round_rows_s, k) if self.round_rows_s
                                 else 0.0, rows)
        # A round holds a target forward at least as wide as a plain step's: a round timed faster than a plain
        # step is noise (a busy machine), and believing it would make a useless drafter look profitable.
        return max(measured, self.plain(rows))

    def _in_rows(self, one: float, measured: float, rows: int) -> float:
        if self.rows <= 1 or rows <= 1 or measured <= 0:
            return one
        per_row = max(0.0, (measured - one) / (self.rows - 1))
        return one + per_row * (rows - 1)


def _on_line(times: tuple[float, ...], k: int) -> float:
    n = len(times)
    if n == 1:
        return times[0]
    mean_k, mean_t = (n + 1) / 2, sum(times) / n
    slope = (sum((i + 1 - mean_k) * (t - mean_t) for i, t in enumerate(times))
             / sum((i + 1 - mean_k) ** 2 for i in range(n)))
    return max(1e-9, mean_t + max(0.0, slope) * (k - mean_k))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one round emits when each draft is accepted with probability `acceptance`: 1 + a + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


def speedups(costs: SpecCosts, acceptance: float, rows: int = 1) -> dict[int, float]:
    """Expected tokens/s with k drafts per round over plain decoding's, for every measured k, when `rows`
    rows decode together (each round and each plain step serves all of them)."""
    return {k: expected_tokens(acceptance, k) / costs.round(k, rows) * costs.plain(rows)
            for k in range(1, costs.k_max + 1)}


@dataclass(frozen=True)
class KChoice:
    k: int  # 0: plain decoding pays more
    speedup: float  # expected, of the chosen k (1.0 when off)
    acceptance: float
    speedups: dict[int, float]


def choose_k(costs: SpecCosts, acceptance: float, margin: float = PROFIT_MARGIN, rows: int = 1) -> KChoice:
    """The k with the best expected tokens/s, or 0 when none beats plain decoding by `margin`. (Taking the
    smallest k near the best instead, to hedge, was tried: on the bundled pair it settled on k = 1 where
    k = 2 ran 4 % faster.)"""
    by_k = speedups(costs, acceptance, rows)
    k = max(by_k, key=by_k.get)
    if by_k[k] < margin:
        return KChoice(0, 1.0, acceptance, by_k)
    return KChoice(k, by_k[k], acceptance, by_k)


class Acceptance:
    """Per-draft acceptance on a model, as decayed counts: recent jobs weigh most."""

    DECAY = 0.9  # per job
    # The load-time rate comes from one built-in prompt, which says less of the traffic than a job does: it
    # weighs as a few drafts, so the first jobs set the rate (on the bundled pair: 0.75 there, 0.87 in use).
    PRIOR_WEIGHT = 8.0

    def __init__(self, rate: float, weight: float = PRIOR_WEIGHT):
        self.accepted, self.judged, self.jobs = rate * weight, weight, 0

    @property
    def rate(self) -> float:
        return self.accepted / self.judged if self.judged else 0.0

    def observe(self, accepted: int, judged: int) -> None:
        if judged <= 0:
            return
        self.accepted = self.accepted * self.DECAY + accepted
        self.judged = self.judged * self.DECAY + judged
        self.jobs += 1


class MeasurementStopped(Exception):
    """A pair's measurement ended early because its node is stopping: nothing is kept, the next load measures."""


class SpecProfile:
    """A loaded pair's measured costs and the acceptance seen per sampling scheme; auto's k comes from it.
    Engine thread only (readers get `as_dict` snapshots)."""

    def __init__(self, costs: SpecCosts, acceptance: dict[str, float]):
        self.costs = costs
        self.acceptance = {scheme: Acceptance(rate) for scheme, rate in acceptance.items()}
        self._unprofitable_jobs = dict.fromkeys(self.acceptance, 0)

    def decide(self, scheme: str, rows: int = 1) -> KChoice:
        """For a job that would speculate with `rows` - 1 others on its model."""
        choice = choose_k(self.costs, self.acceptance[scheme].rate, rows=rows)
        if choice.k or rows > 1:  # probes run alone: beside other jobs one would slow them all
            return choice
        self._unprofitable_jobs[scheme] += 1
        if self._unprofitable_jobs[scheme] % PROBE_EVERY == 0:  # a probe: speculate once to re-measure acceptance
            best = max(choice.speedups, key=choice.speedups.get)
            return KChoice(best, choice.speedups[best], choice.acceptance, choice.speedups)
        return choice

    def observe(self, scheme: str, accepted: int, judged: int) -> None:
        self.acceptance[scheme].observe(accepted, judged)

    def as_dict(self) -> dict:
        c = self.costs
        out = {"plain_token_ms": round(c.plain_token_s * 1000, 3), "round_ms": [round(r * 1000, 3) for r in c.round_s],
               "rows": c.rows, "plain_rows_ms": round(c.plain_rows_s * 1000, 3),
               "round_rows_ms": [round(r * 1000, 3) for r in c.round_rows_s]}
        for scheme, a in self.acceptance.items():
            choice = choose_k(c, a.rate)
            out[scheme] = {"acceptance": round(a.rate, 4), "jobs": a.jobs, "k": choice.k,
                           "expected_speedup": {k: round(v, 3) for k, v in choice.speedups.items()}}
        return out


@dataclass(frozen=True)
class SpecPlan:
    mode: SpecMode
    reason: SpecReason | str  # OK when speculating, else why not (a drafter's reason, or the job's)
    k: int = 0
    choice: KChoice | None = None  # auto's decision, with its numbers

    @property
    def on(self) -> bool:
        return self.mode != SpecMode.OFF


def effective_policy(node_policy: Policy | str, job_policy: Policy | str) -> Policy:
    """A job's `on`/`off` overrides the node; `auto` defers to it."""
    return Policy(node_policy if job_policy == Policy.AUTO else job_policy)


def ineligibility(sampling: SamplingFacts) -> SpecReason | None:
    """What in a request the lossless speculative path cannot honour. Greedy and sampled jobs (top_p, top_k,
    min_p included) both can; logit_bias and penalties change the distribution per emitted token, so a job
    with them decodes plain."""
    if sampling.has_logits_processors:
        return SpecReason.INELIGIBLE_LOGITS_PROCESSORS
    if sampling.prompt_logprobs:  # its prompt is scored where the plain batch reads it
        return SpecReason.INELIGIBLE_PROMPT_LOGPROBS
    return None


def plan(*, policy: Policy | str, drafter_mode: SpecMode | str | None, drafter_reason: str,
         sampling: SamplingFacts, k: int, sharing: int = 0, max_batch: int = 8,
         decide: "Callable[[int], KChoice] | None" = None) -> SpecPlan:
    """One job's plan. `drafter_mode` is the loaded drafter's, or None with `drafter_reason` saying why.
    `sharing` jobs already run on the model; under `auto`, a job speculates only while the model's jobs
    number at most `max_batch` (past that, a batch's rows keep the hardware busy without drafts), and
    with the k `decide` picks from measured costs and acceptance (none: the configured k). `on` always
    uses the configured k."""
    if policy == Policy.OFF:
        return SpecPlan(SpecMode.OFF, SpecReason.POLICY_OFF)
    if drafter_mode is None:
        return SpecPlan(SpecMode.OFF, drafter_reason)
    why = ineligibility(sampling)
    if why is not None:
        return SpecPlan(SpecMode.OFF, why)
    if policy == Policy.AUTO and sharing + 1 > max_batch:
        return SpecPlan(SpecMode.OFF, SpecReason.BATCH_TOO_LARGE)
    if policy == Policy.AUTO and not sampling.greedy and sampling.seed is not None:
        # Plain and speculative sampling draw differently from the same seed, and auto's choice follows what
        # it measures: a seed must give the same tokens every time, so under auto it decodes plain.
        return SpecPlan(SpecMode.OFF, SpecReason.INELIGIBLE_SEED)
    if policy == Policy.AUTO and decide is not None:
        choice = decide(sharing + 1)
        if not choice.k:
            return SpecPlan(SpecMode.OFF, SpecReason.NOT_PROFITABLE, choice=choice)
        return SpecPlan(SpecMode(drafter_mode), SpecReason.OK, choice.k, choice)
    return SpecPlan(SpecMode(drafter_mode), SpecReason.OK, k)
