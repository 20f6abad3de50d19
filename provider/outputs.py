"""What a job emits: `Accepted`, then `Tokens` chunks, then exactly one terminal event (`Done` or `Error`), and the
parts they carry (usage, logprobs, tool calls, the proof a verifier reads). The request side is provider/jobs.py.

The engine makes them and delivers them to a `Sink` on its thread; both front ends translate them into their wire's
shapes (as vLLM keeps its RequestOutput apart from the request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from .proofs.verdicts import VerdictSummary
from .telemetry import Telemetry
from .types import Cause, FinishReason, JobError, JobId


@dataclass(frozen=True)
class Accepted:
    job_id: JobId
    model: str
    prompt_tokens: int


@dataclass(frozen=True)
class ToolCall:
    id: str  # call_<hex>, unique per call
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model (before any sampling transform), and its best alternatives
    (id, text, logprob, raw bytes), best first. `raw`: the token's exact bytes (a piece of a multi-byte
    character is its own bytes; its `text` shows U+FFFD)."""

    token: int
    text: str
    logprob: float | None  # None for a prompt's first token: nothing before it scores it
    top: tuple[tuple[int, str, float, bytes], ...] = ()
    raw: bytes = b""


@dataclass(frozen=True)
class Tokens:
    job_id: JobId
    seq: int  # 0, 1, 2, ... per job, no gaps
    text: str  # content: the output minus any tool calls
    token_ids: tuple[int, ...]
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed with these tokens
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the job asked (and the end token's, with no id)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # a scored prompt's, on the job's first chunk


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, those served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_prompt_tokens},
        }


@dataclass(frozen=True)
class Proof:
    """What a verifier needs beyond the request and the tokens (provider.verification): the commitment to each
    token's hidden state (None when this model's family cannot make one), and how sampled tokens were drawn."""

    commitment: bytes | None
    sampler: str  # GREEDY, REPLAYABLE (seeded Gumbel draws, `seed`) or SPECULATIVE (not replayable)
    seed: int | None = None
    # The end id the model chose after the output, when it ended on one (not a stop string, not max_tokens): the
    # commitment covers its row too, and a verifier judges it as the output's last token, so an output cut short
    # with a made-up end is caught. None: the output did not end on an end token.
    end_token: int | None = None


GREEDY_SAMPLER, REPLAYABLE_SAMPLER, SPECULATIVE_SAMPLER = "greedy", "replayable", "speculative"


@dataclass(frozen=True)
class Done:
    job_id: JobId
    finish_reason: FinishReason
    usage: Usage
    telemetry: Telemetry
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # per prompt token, when it was scored
    stop_sequence: str | None = None  # the stop string that ended it (Anthropic's stop_reason names it)
    proof: Proof | None = None  # a committing node's (Settings.committing)
    verdict: VerdictSummary | None = None  # a verify job's


@dataclass(frozen=True)
class Error:
    job_id: JobId
    cause: Cause
    message: str
    param: str | None = None  # the request field at fault, when one is

    @classmethod
    def of(cls, job_id: JobId, e: JobError) -> "Error":
        return cls(job_id, e.cause, e.message, e.param)


Event = Union[Accepted, Tokens, Done, Error]
Sink = Callable[[Event], None]  # where the engine delivers a job's events (on its thread; must not block)
TERMINAL = (Done, Error)
