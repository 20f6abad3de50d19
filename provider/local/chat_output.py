"""Job results -> OpenAI response bodies and stream chunks, logprobs in OpenAI's two shapes. Pure: no I/O."""

from __future__ import annotations

import base64
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from ..outputs import Done, TokenLogprob, ToolCall, Usage
from ..status import NodeStatus
from ..types import FinishReason


@dataclass
class ChoiceResult:
    """One choice as it ended: its text (the echoed prompt not included), calls and logprobs."""

    index: int
    done: Done
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # its token ids (a proof commits to them)


def _envelope(job_id: str, model: str, obj: str, created: int) -> dict[str, Any]:
    return {"id": job_id, "object": obj, "created": created, "model": model}


def usage_of(choices: list[ChoiceResult], n: int) -> Usage:
    """Each prompt's tokens once (its first choice's, which the others reuse), every choice's completion."""
    firsts = [c.done.usage for c in choices if c.index % n == 0]
    return Usage(sum(u.prompt_tokens for u in firsts), sum(c.done.usage.completion_tokens for c in choices),
                 sum(u.cached_prompt_tokens for u in firsts))


def _totals(choices: list[ChoiceResult], n: int) -> dict[str, Any]:
    return {"usage": usage_of(choices, n).as_dict(), "telemetry": choices[0].done.telemetry.as_dict()}


def _own_telemetry(choices: list[ChoiceResult], c: ChoiceResult) -> dict[str, Any]:
    return ({"telemetry": c.done.telemetry.as_dict()} if len(choices) > 1 else {}) | proof_of(c.done, c.ids)


def proof_of(done: Done, ids: list[int]) -> dict[str, Any]:
    """A committing node's proof of a choice (docs/verification.md), with the token ids it commits to: what
    `provider verify` and a verify job take."""
    p = done.proof
    if p is None:
        return {}
    return {"proof": {"commitment": base64.b64encode(p.commitment or b"").decode(), "sampler": p.sampler,
                      "seed": p.seed, "end_token": p.end_token, "output_ids": list(ids)}}


def client_finish_reason(done: Done) -> str:
    """What a client is told of how a choice ended: a job cut short (its client left, a deadline, a drain that ran
    out) ends as its output stands, "length", a reason every OpenAI client knows; its telemetry says "cancelled"."""
    return FinishReason.LENGTH.value if done.finish_reason == FinishReason.CANCELLED else done.finish_reason.value


def chat_response(job_id: str, model: str, choices: list[ChoiceResult], created: int, n: int,
                  logprobs: bool) -> dict[str, Any]:
    out = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.text if c.text or not c.calls else None,
                                   "refusal": None}
        if c.calls:
            message["tool_calls"] = [tool_call_dict(call) for call in c.calls]
        out.append({"index": c.index, "message": message, "finish_reason": client_finish_reason(c.done),
                    "logprobs": chat_logprobs(c.logprobs) if logprobs else None} | _own_telemetry(choices, c))
    return _envelope(job_id, model, "chat.completion", created) | {"choices": out} | _totals(choices, n)


def completion_response(job_id: str, model: str, choices: list[ChoiceResult], created: int, n: int,
                        logprobs: bool, echoes: list[str] | None) -> dict[str, Any]:
    """With `echoes`, each choice's text starts with its prompt's (its logprobs already start with the
    prompt's tokens)."""
    out = []
    for c in choices:
        echo = echoes[c.index // n] if echoes is not None else ""
        out.append({"index": c.index, "text": echo + c.text, "finish_reason": client_finish_reason(c.done),
                    "logprobs": completion_logprobs(c.logprobs, echo)[0] if logprobs else None}
                   | _own_telemetry(choices, c))
    return _envelope(job_id, model, "text_completion", created) | {"choices": out} | _totals(choices, n)


# --- logprobs -----------------------------------------------------------------------


def chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    """Chat's shape: per token its text, logprob, exact bytes and best alternatives."""
    return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.raw),
                         "top_logprobs": [{"token": text, "logprob": lp, "bytes": list(raw)}
                                          for _, text, lp, raw in t.top]} for t in lps],
            "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], echo: str = "", offset: int = 0) -> tuple[dict[str, Any], int]:
    """The completions shape: parallel lists; each token's alternatives as {text: logprob}, its own token
    included (as vLLM does), so a client can tell whether it was the best. A prompt's first token has
    null for both. And where the next token begins.

    `text_offset` is one rule whether streamed or whole: a token begins where the texts of the tokens before
    it end, from `offset`. (Counting the stream's text instead would differ: it holds back the bytes of a
    character not yet whole.) A BOS the echoed prompt does not show takes no room."""
    tokens, values, tops, offsets = [], [], [], []
    for t in lps:
        tokens.append(t.text)
        values.append(t.logprob)
        top = None
        if t.logprob is not None:
            top = {text: lp for _, text, lp, _ in t.top}
            top.setdefault(t.text, t.logprob)
        tops.append(top)
        offsets.append(offset)
        if not (t.logprob is None and _unshown(t.text, echo)):
            offset += len(t.text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def _unshown(token: str, text: str) -> bool:
    """A prompt's first token (the one nothing scores) that the text does not show: a BOS the tokenizer added to a prompt sent as text takes no
    room in the echo (a leading-space token of a SentencePiece vocabulary still does)."""
    return bool(token) and not text.startswith(token) and not text.startswith(token.lstrip())


# --- streams -------------------------------------------------------------------------


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_deltas(calls: list[ToolCall], first_index: int) -> list[list[dict[str, Any]]]:
    """Each call as OpenAI streams one: a delta with its index, id and name, then one with its arguments."""
    out = []
    for i, c in enumerate(calls, first_index):
        out.append([{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}])
        out.append([{"index": i, "function": {"arguments": c.arguments}}])
    return out


def chat_chunk(job_id: str, model: str, created: int, *, index: int = 0, text: str | None = None,
               role: bool = False, finish_reason: str | None = None, tool_calls: list[dict] | None = None,
               logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return _envelope(job_id, model, "chat.completion.chunk", created) | {
        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                     "logprobs": chat_logprobs(logprobs) if logprobs is not None else None}]
    }


def completion_chunk(job_id: str, model: str, created: int, *, index: int = 0, text: str = "",
                     finish_reason: str | None = None,
                     logprobs_json: dict[str, Any] | None = None) -> dict[str, Any]:
    return _envelope(job_id, model, "text_completion", created) | {
        "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs_json}]
    }


def usage_chunk(job_id: str, model: str, created: int, obj: str, usage: Usage, done: Done) -> dict[str, Any]:
    """The last chunk before [DONE]: no choices, usage and telemetry (as with include_usage)."""
    return _envelope(job_id, model, obj, created) | {
        "choices": [], "usage": usage.as_dict(), "telemetry": done.telemetry.as_dict()
    }


def health_body(st: NodeStatus) -> dict[str, Any]:
    return {
        "status": st.health,
        "default_model": st.default_model,
        "models": [m.id for m in st.models],
        "resident_models": st.resident,
        "resident": [{k: v for k, v in dataclasses.asdict(m).items() if k != "facts"}
                     for m in st.models if m.state != "available"],
        "memory": dataclasses.asdict(st.memory),
        "active_jobs": st.active_jobs,
        "queued_jobs": st.queued_jobs,
        "queue": dataclasses.asdict(st.queue),
        "counters": dataclasses.asdict(st.counters),
        "group": dataclasses.asdict(st.group) if st.group is not None else None,
        "prefix_disk": dataclasses.asdict(st.prefix_disk) if st.prefix_disk is not None else None,
    }


def now() -> int:
    return int(time.time())
