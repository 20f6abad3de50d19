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
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    target_forwards: int = 0  # the prefill forward counts
    tokens_per_target_forward: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Off: just the mode and why; on: every counter."""
        if self.mode == SpecMode.OFF:
            return {"mode": self.mode.value, "reason": self.reason}
        return dataclasses.asdict(self) | {"mode": self.mode.value}


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
