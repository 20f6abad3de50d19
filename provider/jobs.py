"""The one job path: a `Job` goes in, `Event`s come out.

Both front ends (the coordinator session and the local HTTP API) translate
their requests into a Job and translate Events back; neither touches MLX.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Union


class Cause(str, enum.Enum):
    """Closed set of reasons a job fails. Front ends map these to HTTP codes or proto enums."""

    INVALID_REQUEST = "invalid_request"
    UNKNOWN_MODEL = "unknown_model"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_LOAD_FAILED = "model_load_failed"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    SPECULATION_UNAVAILABLE = "speculation_unavailable"
    OVERLOADED = "overloaded"
    DRAINING = "draining"
    COORDINATOR_LOST = "coordinator_lost"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    DUPLICATE_JOB = "duplicate_job"
    INTERNAL = "internal"


class JobError(Exception):
    """A typed failure of one job. The node keeps serving."""

    def __init__(self, cause: Cause, message: str):
        super().__init__(message)
        self.cause = cause
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Logits processors (mlx-lm's): honoured on the plain path; speculation steps aside for them.
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def has_logits_processors(self) -> bool:
        return bool(self.logit_bias or self.repetition_penalty or self.presence_penalty or self.frequency_penalty)

    def __post_init__(self) -> None:
        # The same bounds for every front end; each also checks its own wire types.
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be from 0 to 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be > 0 and <= 1"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be from 0 to 1"),
            ("stop", len(self.stop) <= 16, "allows at most 16 strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative"),
            ("logit_bias", all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias), "needs token ids >= 0 and "
             "biases from -100 to 100"),
            ("repetition_penalty", self.repetition_penalty is None or 0 < self.repetition_penalty <= 10,
             "must be > 0 and <= 10"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be from -2 to 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be from -2 to 2"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise JobError(Cause.INVALID_REQUEST, f"{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Job:
    """One generation request. Exactly one of `prompt` (raw text) or `messages` (chat) is set."""

    id: str
    model: str
    sampling: SamplingParams
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    speculation: str = "auto"  # auto | on | off

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise JobError(Cause.INVALID_REQUEST, "a job needs exactly one of prompt or messages")


@dataclass(frozen=True)
class Accepted:
    job_id: str
    model: str
    prompt_tokens: int


@dataclass(frozen=True)
class Tokens:
    job_id: str
    seq: int  # 0, 1, 2, ... per job, no gaps
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


@dataclass(frozen=True)
class Done:
    job_id: str
    finish_reason: str  # stop | length | cancelled
    usage: Usage
    telemetry: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Error:
    job_id: str
    cause: Cause
    message: str


Event = Union[Accepted, Tokens, Done, Error]
TERMINAL = (Done, Error)
