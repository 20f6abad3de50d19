"""What the agent-facing APIs (Anthropic Messages, OpenAI Responses) share at the edge: the record of what a
request asked that the node left out, max_tokens clamped to what the node and the model's context can give,
tool schemas trimmed to what the grammar enforces, and running the one job the request became.

Coding agents send fields, hosted tools and schema keywords a local node cannot serve, and a max_tokens sized for
a hosted model's window. A 400 there stops the agent, so these are accepted, left out, and said in the answer's
telemetry (`left_out`, `max_tokens`) and on the node's log, never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web

from .. import logs
from ..constraints import ANNOTATIONS, ENFORCED, MAX_DESCRIPTION_CHARS, MAX_TOOLS, NAME, Tool, subschemas
from ..jobs import Job, JobError
from ..outputs import Done, Error, Event, Tokens, Usage
from ..node import Node
from . import openai_api as api
from .choices import merged, open_choices
from .completions import JOB_ID, USAGE

log = logs.get("local")
MAX_LEFT_OUT = 32  # notes kept per request: a hostile body cannot grow the answer without bound
# Entries of `tools` read at all (hosted tools, namespaces' members and repeats included), counted before any is
# built: past the first MAX_TOOLS functions the rest are left out, and past this many the request is refused.
MAX_TOOLS_SENT = 4 * MAX_TOOLS
# A streamed answer says it is alive after this long without an event. Agents drop a stream idle for 300 s
# (Claude Code's floor; Codex's stream_idle_timeout_ms default) and send the request again from the start, and
# an agent's 20-25k-token prompt takes longer than that to read on a CPU.
KEEPALIVE_S = 15.0


@dataclass
class EdgeNotes:
    """What one request asked that was left out, and how its max_tokens was served."""

    api: str
    left_out: list[str] = field(default_factory=list)
    max_tokens_asked: int | None = None
    max_tokens: int = 0
    clamped_by: str | None = None  # "node_limit" | "context"

    def leave_out(self, what: str) -> None:
        if what not in self.left_out and len(self.left_out) < MAX_LEFT_OUT:
            self.left_out.append(what)

    def fields(self, body: dict[str, Any], served: frozenset[str]) -> None:
        """Every top-level field given (not null) that this API's translation does not serve."""
        for key in body:
            if key not in served and body[key] is not None:
                self.leave_out(f"field {key[:64]}")

    def clamp(self, asked: int | None, default: int, limit: int) -> int:
        """max_tokens within the node's limit (an agent sizes it for a hosted model); the model's context is
        applied once the prompt's length is known (`fit_context`)."""
        if asked is None:
            self.max_tokens = default
            return default
        self.max_tokens_asked = asked
        self.max_tokens = min(asked, limit)
        if asked > limit:
            self.clamped_by = "node_limit"
        return self.max_tokens

    def fit_context(self, prompt_tokens: int, context: int | None) -> None:
        """The engine generates at most the room the prompt leaves in the context; say so when that is less."""
        if context is None:
            return
        room = max(context - prompt_tokens, 0)
        if self.max_tokens > room:
            self.max_tokens, self.clamped_by = room, "context"

    def telemetry(self, done: Done | None) -> dict[str, Any]:
        out = done.telemetry.as_dict() if done is not None else {}
        out["left_out"] = list(self.left_out)
        out["max_tokens"] = {"asked": self.max_tokens_asked, "served": self.max_tokens, "clamped_by": self.clamped_by}
        return out


def check_max_tokens(value: Any, param: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise api.RequestError(f"{param} must be a positive integer", param)


def agent_tool(name: Any, description: Any, schema: Any, notes: EdgeNotes, param: str) -> Tool | None:
    """A client's function as the node offers it: schema keywords the grammar cannot enforce dropped, a long
    description cut (both noted), or None (noted) when it cannot be offered at all."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        notes.leave_out(f"tool {str(name)[:64]!r} (a name must be 1 to 64 letters, digits, '_' or '-')")
        return None
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise api.RequestError(f"{param}.description must be a string", param)
    if len(description) > MAX_DESCRIPTION_CHARS:
        notes.leave_out(f"tool {name}: description past {MAX_DESCRIPTION_CHARS} characters")
        description = description[:MAX_DESCRIPTION_CHARS]
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise api.RequestError(f"{param}: the schema of {name} must be a JSON object", param)
    dropped = sorted(_trim_schema(schema))
    if dropped:
        notes.leave_out(f"tool {name}: schema keywords {', '.join(dropped[:8])}")
    try:
        return Tool(name, schema, description)
    except JobError as e:
        raise api.RequestError(e.message, param) from None


def _trim_schema(schema: dict) -> set[str]:
    """Drop, in place, the keywords no grammar enforces (propertyNames, uniqueItems, if/then...): an agent's
    schemas are written for a hosted model, and a keyword the node would refuse would stop the agent."""
    dropped: set[str] = set()
    for node in subschemas(schema, most=100_000):  # a schema is bounded later (check_schema); this walk here
        for key in [k for k in node if k not in ENFORCED and k not in ANNOTATIONS]:
            dropped.add(str(key)[:32])
            del node[key]
    return dropped


def check_tools_sent(n: int) -> None:
    if n > MAX_TOOLS_SENT:
        raise api.RequestError(f"tools may hold at most {MAX_TOOLS_SENT} entries (the node offers the first "
                               f"{MAX_TOOLS} functions of them), got {n}", "tools")


def bounded_tools(tools: list[Tool], notes: EdgeNotes) -> tuple[Tool, ...]:
    """At most MAX_TOOLS, each name once (the first kept)."""
    out: dict[str, Tool] = {}
    for t in tools:
        if t.name in out:
            notes.leave_out(f"tool {t.name} (repeated)")
        elif len(out) >= MAX_TOOLS:
            notes.leave_out(f"tools past the first {MAX_TOOLS}")
        else:
            out[t.name] = t
    return tuple(out.values())


def context_of(node: Node, model: str) -> int | None:
    for m in node.status().models:
        if m.id == model and m.facts is not None:
            return m.facts.context_length
    return None


@contextlib.asynccontextmanager
async def run_job(node: Node, request: web.Request, job: Job, notes: EdgeNotes, *, tools: int = 0):
    """Start the job (a refusal raises its RequestError before any answer is begun); yield the served model
    and its events as (token events coalesced, the event that ended the batch). Leaving cancels the job if it
    still runs."""
    request[JOB_ID] = job.id
    async with contextlib.AsyncExitStack() as stack:
        req = api.ParsedRequest((job,), stream=False, include_usage=False)
        model, choices = await open_choices(node, req, stack)
        log.info("agent_request", api=notes.api, job_id=job.id, model=model, tools=tools,
                 tool_choice=job.rules.tool_choice.mode, left_out=notes.left_out or None,
                 max_tokens=notes.max_tokens, max_tokens_asked=notes.max_tokens_asked)
        context = context_of(node, model)

        async def events() -> AsyncIterator[tuple[list[Tokens], Event | None]]:
            async for _, batch, end in merged(choices):
                if isinstance(end, Done):
                    request[USAGE] = end.usage
                    notes.fit_context(end.usage.prompt_tokens, context)
                yield batch, end

        yield model, events()


def usage_counts(usage: Usage) -> tuple[int, int, int]:
    """(prompt tokens computed, prompt tokens read from the prefix cache, output tokens)."""
    return usage.prompt_tokens - usage.cached_prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens


async def kept_alive(events, every: float = KEEPALIVE_S) -> AsyncIterator[tuple[list[Tokens], Event | None] | None]:
    """`run_job`'s events, with a None between them whenever `every` seconds pass without one (the stream then
    writes its API's keepalive event). Leaving stops the pending read (and so, through run_job, the job)."""
    it = aiter(events)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            ready, pending = pending, None
            try:
                item = ready.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


async def collected(events) -> tuple[str, list, Done]:
    """A job's whole answer from `run_job`'s events: its text, its tool calls and its end (a failure raised)."""
    text, calls = [], []
    async for batch, end in events:
        for ev in batch:
            text.append(ev.text)
            calls += ev.tool_calls
        if isinstance(end, Error):
            raise failed(end)
        if isinstance(end, Done):
            return "".join(text), calls, end
    raise api.RequestError("the job ended without a result", status=500, type_="server_error")


def failed(end: Error) -> api.RequestError:
    return api.error_for(end.cause, end.message, end.param)
