"""Per-job telemetry as typed data, serialised only at the edges (JSON for HTTP, protobuf for gRPC)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .types import FinishReason, SpecMode, SpecReason


@dataclass
class SpecTelemetry:
    """A job's speculation: the mode and why, and while it speculates, the counters its rounds add to (on the
    engine thread; a job's Done carries a copy taken when it ends). `as_dict` is what both transports send."""

    mode: SpecMode | str
    reason: SpecReason | str = SpecReason.OK  # OK when speculating, else why not (a stable reason)
    k: int = 0
    sampling_scheme: str = ""  # greedy | speculative_sampling, while speculating
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    judged: int = 0  # drafts the target ruled on (a round stops at its first rejection): accepted / judged
    target_forwards: int = 0  # the prefill forward counts
    emitted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    batch_rows: int = 0  # summed over rounds: rows / rounds is the mean batch this job's rounds ran in
    # Sampled rounds, over the drafts judged: the sum of Σ min(p, q) (this scheme's acceptance probability)
    # and of Σ p·q (what sample-and-compare, mlx-lm's scheme, would accept there).
    min_overlap: float = 0.0
    dot_overlap: float = 0.0
    # Constrained rows: drafts whose drafter's own first choice the grammar forbade, so the mask redirected it
    # (drafts are drawn under the grammar, so none the target judges is forbidden).
    grammar_steered: int = 0
    choice: Any = None  # auto's speculation.KChoice: its decision from measured costs, when it made one

    @property
    def acceptance_rate(self) -> float:
        return round(self.accepted / self.drafted, 4) if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return round(self.emitted / self.target_forwards, 4) if self.target_forwards else 0.0

    @property
    def mean_batch(self) -> float:
        """Rows verified together per round, on average."""
        return round(self.batch_rows / self.rounds, 3) if self.rounds else 0.0

    @property
    def decision(self) -> dict[str, Any] | None:
        """Auto's decision as telemetry carries it: per-draft acceptance and expected speedup per k."""
        return decision_dict(self.choice)

    def as_dict(self) -> dict[str, Any]:
        """Off: the mode and why (with auto's numbers when it judged speculation not profitable); on: every
        counter."""
        mode, decision = SpecMode(self.mode).value, self.decision
        if mode == SpecMode.OFF:
            return {"mode": mode, "reason": str(self.reason)} | ({"decision": decision} if decision else {})
        out = {"mode": mode, "reason": str(self.reason), "k": self.k, "sampling_scheme": self.sampling_scheme,
               "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
               "acceptance_rate": self.acceptance_rate, "target_forwards": self.target_forwards,
               "tokens_per_target_forward": self.tokens_per_target_forward,
               "draft_ms": round(self.draft_s * 1000, 3), "verify_ms": round(self.verify_s * 1000, 3),
               "mean_batch": self.mean_batch, "grammar_steered": self.grammar_steered}
        return out | ({"decision": decision} if decision else {})


def decision_dict(choice) -> dict[str, Any] | None:
    """A speculation.KChoice as telemetry carries it, with where its costs came from when it knows
    (models.profile_store.SourcedChoice: `profile` source file | measured, and when)."""
    if choice is None:
        return None
    out = {"k": choice.k, "acceptance": round(choice.acceptance, 4),
           "expected_speedup": {str(k): round(v, 3) for k, v in choice.speedups.items()}}
    origin = getattr(choice, "origin", None)
    if origin is not None:
        out["profile"] = {"source": origin.source, "measured_at": origin.as_dict()["measured_at"]}
    return out


@dataclass(frozen=True)
class Telemetry:
    finish_reason: FinishReason
    speculation: SpecTelemetry
    ttft_ms: float | None = None  # from arrival to the first token
    queue_ms: float = 0.0
    total_ms: float = 0.0
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None  # after the first token
    peak_memory_bytes: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefix_tier: str = ""  # which of its tiers: memory | disk ("" when none)
    constraint: str | None = None  # a constrained job's kind (json_object, json_schema, tool_call, tools_auto...)
    mask_ms_per_token: float | None = None  # the grammar's mask time, per mask computed

    def as_dict(self) -> dict[str, Any]:
        out = {"ttft_ms": self.ttft_ms, "cached_prompt_tokens": self.cached_prompt_tokens,
               "prefix_tier": self.prefix_tier, "queue_ms": self.queue_ms,
               "total_ms": self.total_ms, "prefill_tokens_per_s": self.prefill_tokens_per_s,
               "decode_tokens_per_s": self.decode_tokens_per_s, "peak_memory_bytes": self.peak_memory_bytes,
               "finish_reason": self.finish_reason.value, "speculation": self.speculation.as_dict()}
        if self.constraint is not None:
            out |= {"constraint": self.constraint, "mask_ms_per_token": self.mask_ms_per_token}
        return out


NOT_STARTED = Telemetry(FinishReason.CANCELLED, SpecTelemetry(SpecMode.OFF, SpecReason.NOT_STARTED))
