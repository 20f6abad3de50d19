"""Per-job telemetry as typed data, serialised only at the edges (JSON for HTTP, protobuf for gRPC)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from .speculation import SpecMode


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token or a stop string
    LENGTH = "length"  # max_tokens, or the context
    CANCELLED = "cancelled"  # the client left, the coordinator cancelled, the deadline passed, or a drain ran out


@dataclass(frozen=True)
class SpecTelemetry:
    mode: SpecMode
    reason: str  # "ok" when speculating, else why not (a stable reason)
    k: int = 0
    sampling_scheme: str = ""  # greedy | speculative_sampling, while speculating
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    target_forwards: int = 0  # the prefill forward counts
    tokens_per_target_forward: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    mean_batch: float = 0.0  # rows verified together per round, on average
    # Auto's decision from measured costs: per-draft acceptance and expected speedup per k.
    decision: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """Off: the mode and why (with auto's numbers when it judged speculation not profitable); on: every
        counter."""
        if self.mode == SpecMode.OFF:
            off = {"mode": self.mode.value, "reason": self.reason}
            return off | ({"decision": self.decision} if self.decision else {})
        out = dataclasses.asdict(self) | {"mode": self.mode.value}
        return out if self.decision else {k: v for k, v in out.items() if k != "decision"}


def decision_dict(choice) -> dict[str, Any] | None:
    """A speculation.KChoice as telemetry carries it."""
    if choice is None:
        return None
    return {"k": choice.k, "acceptance": round(choice.acceptance, 4),
            "expected_speedup": {str(k): round(v, 3) for k, v in choice.speedups.items()}}


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

    def as_dict(self) -> dict[str, Any]:
        return {"ttft_ms": self.ttft_ms, "cached_prompt_tokens": self.cached_prompt_tokens, "queue_ms": self.queue_ms, "total_ms": self.total_ms,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "peak_memory_bytes": self.peak_memory_bytes, "finish_reason": self.finish_reason.value,
                "speculation": self.speculation.as_dict()}


NOT_STARTED = Telemetry(FinishReason.CANCELLED, SpecTelemetry(SpecMode.OFF, "not_started"))
