"""Rank 0's plan for one engine step, and its form on the wire: plain JSON of explicit fields, never objects by
name. `decode_plan` is the follower's side: every field is checked for its type and bounds and every value is
rebuilt by the same constructors that check a request at the node's edge, so a plan can only ever say what a
request could. (The bytes are authenticated before this sees them: provider.group.link.)"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..constraints import OutputRules, ResponseFormat, Tool, ToolChoice
from ..jobs import MAX_PROMPT_IDS, Job, SamplingParams
from ..speculation import SpecPlan
from ..types import JobError, SpecMode

MAX_CHANGES = 4096  # rows started or cancelled in one step: far above any batch
MAX_ID_CHARS = 256
MAX_REASON_CHARS = 64


@dataclass(frozen=True)
class StartRow:
    job: Job  # its seed fixed by rank 0
    prompt: tuple[int, ...]
    max_tokens: int
    plan: SpecPlan
    shared_prefix: int  # where its prompt's reads split: the same on every rank, or the forwards differ


@dataclass(frozen=True)
class CancelRow:
    job_id: str


@dataclass(frozen=True)
class StepPlan:
    changes: tuple[StartRow | CancelRow, ...] = ()
    stop: bool = False  # rank 0's engine ended: the followers end too


class PlanError(ValueError):
    """A plan that does not parse: the group cannot go on (rank 0 and this rank disagree on what runs)."""


# --- rank 0: a plan as JSON ------------------------------------------------------------------------------------

def encode_plan(plan: StepPlan) -> dict:
    return {"stop": plan.stop, "changes": [_encode_change(c) for c in plan.changes]}


def _encode_change(change: StartRow | CancelRow) -> dict:
    if isinstance(change, CancelRow):
        return {"cancel": change.job_id}
    job, spec = change.job, change.plan
    return {"start": {
        "id": job.id, "model": job.model, "speculation": job.speculation.value, "share_prompt": job.share_prompt,
        "sampling": {f.name: _plain(getattr(job.sampling, f.name)) for f in dataclasses.fields(SamplingParams)},
        "rules": _encode_rules(job.rules),
        "prompt": list(change.prompt), "max_tokens": change.max_tokens, "shared_prefix": change.shared_prefix,
        "spec": {"mode": spec.mode.value, "reason": str(spec.reason), "k": spec.k},
    }}


def _encode_rules(rules: OutputRules) -> dict:
    rf = rules.response_format
    return {"response_format": None if rf is None else {"type": rf.type, "schema": rf.schema, "name": rf.name},
            "tools": [{"name": t.name, "parameters": t.parameters, "description": t.description} for t in rules.tools],
            "tool_choice": {"mode": rules.tool_choice.mode, "name": rules.tool_choice.name},
            "parallel_tool_calls": rules.parallel_tool_calls}


def _plain(value: Any) -> Any:
    """Tuples (of tuples) as lists: what JSON has."""
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


# --- a follower: JSON back into a plan, every field checked ------------------------------------------------------

def decode_plan(raw: Any, vocab_size: int) -> StepPlan:
    body = _fields(raw, "plan", {"stop", "changes"})
    changes = _typed(body["changes"], list, "plan.changes")
    if len(changes) > MAX_CHANGES:
        raise PlanError(f"a plan of {len(changes)} changes (at most {MAX_CHANGES})")
    try:
        return StepPlan(tuple(_decode_change(c, vocab_size) for c in changes), _typed(body["stop"], bool, "plan.stop"))
    except JobError as e:  # a value no request could carry
        raise PlanError(f"a plan's job does not hold: {e.message}") from None


def _decode_change(raw: Any, vocab_size: int) -> StartRow | CancelRow:
    if isinstance(raw, dict) and set(raw) == {"cancel"}:
        return CancelRow(_text(raw["cancel"], "cancel", MAX_ID_CHARS))
    row = _fields(_fields(raw, "change", {"start"})["start"], "start",
                  {"id", "model", "speculation", "share_prompt", "sampling", "rules", "prompt", "max_tokens",
                   "shared_prefix", "spec"})
    prompt = _typed(row["prompt"], list, "prompt")
    if not 0 < len(prompt) <= MAX_PROMPT_IDS or not all(type(t) is int and 0 <= t < vocab_size for t in prompt):
        raise PlanError(f"a plan's prompt must be 1 to {MAX_PROMPT_IDS} token ids below {vocab_size}")
    max_tokens = _typed(row["max_tokens"], int, "max_tokens")
    shared_prefix = _typed(row["shared_prefix"], int, "shared_prefix")
    if max_tokens < 0 or not 0 <= shared_prefix <= len(prompt):
        raise PlanError("a plan's max_tokens or shared_prefix is out of range")
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    sampling = _fields(row["sampling"], "sampling", names)
    sampling = {k: _tuples(v) if k in ("stop", "stop_token_ids", "logit_bias") else v for k, v in sampling.items()}
    job = Job(_text(row["id"], "id", MAX_ID_CHARS), _text(row["model"], "model", MAX_ID_CHARS),
              SamplingParams(**sampling),
              # The prompt is already rendered into token ids (`prompt` above): a follower never renders, so the
              # job carries no messages (an empty chat, which is what lets tool rules stand without them).
              messages=(), rules=_decode_rules(row["rules"]), speculation=_text(row["speculation"], "speculation", 8),
              share_prompt=_typed(row["share_prompt"], bool, "share_prompt"))
    spec = _fields(row["spec"], "spec", {"mode", "reason", "k"})
    try:
        mode = SpecMode(_text(spec["mode"], "spec.mode", 8))
    except ValueError:
        raise PlanError("a plan's speculation mode is not one of off, draft, mtp") from None
    k = _typed(spec["k"], int, "spec.k")
    if not 0 <= k <= 64:
        raise PlanError("a plan's speculation k is out of range")
    return StartRow(job, tuple(prompt), max_tokens, SpecPlan(mode, _text(spec["reason"], "spec.reason",
                                                                         MAX_REASON_CHARS), k), shared_prefix)


def _decode_rules(raw: Any) -> OutputRules:
    body = _fields(raw, "rules", {"response_format", "tools", "tool_choice", "parallel_tool_calls"})
    rf = body["response_format"]
    if rf is not None:
        rf = _fields(rf, "response_format", {"type", "schema", "name"})
        rf = ResponseFormat(_text(rf["type"], "response_format.type", 16), rf["schema"],
                            _text(rf["name"], "response_format.name", 64))
    tools = []
    for t in _typed(body["tools"], list, "tools"):
        t = _fields(t, "tool", {"name", "parameters", "description"})
        tools.append(Tool(t["name"], _typed(t["parameters"], dict, "tool.parameters"), t["description"]))
    choice = _fields(body["tool_choice"], "tool_choice", {"mode", "name"})
    return OutputRules(rf, tuple(tools), ToolChoice(choice["mode"], choice["name"]),
                       _typed(body["parallel_tool_calls"], bool, "parallel_tool_calls"))


def _fields(raw: Any, what: str, names: set[str]) -> dict:
    if not isinstance(raw, dict) or set(raw) != names:
        raise PlanError(f"a plan's {what} must be an object with exactly the fields {', '.join(sorted(names))}")
    return raw


def _typed(value: Any, kind: type, what: str) -> Any:
    if type(value) is not kind:  # exact: a bool is not an int here
        raise PlanError(f"a plan's {what} must be of type {kind.__name__}")
    return value


def _text(value: Any, what: str, limit: int) -> str:
    if type(value) is not str or not 0 < len(value) <= limit:
        raise PlanError(f"a plan's {what} must be a string of 1 to {limit} characters")
    return value


def _tuples(value: Any) -> Any:
    """Lists back into the tuples SamplingParams holds (its own checks then see every value)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
