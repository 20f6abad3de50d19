"""POST /v1/chat/completions and /v1/completions: a request's jobs (a choice each) run, their events sent back
whole or as server-sent events, choices interleaved by index as they come."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Callable

from aiohttp import web

from ..outputs import Done, Error, TokenLogprob, Usage
from ..node import Node
from . import openai_api as api
from . import chat_output as out
from .bodies import off_loop, read_parsed
from .choices import Choice, merged, open_choices

# What the access line reports of a request that ran a job.
JOB_ID = web.RequestKey("job_id", str)
USAGE = web.RequestKey("usage", Usage)


class Completions:
    def __init__(self, node: Node, limits: api.Limits):
        self.node = node
        self.limits = limits

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api.parse_chat, "chatcmpl", chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api.parse_completion, "cmpl", chat=False)

    async def _serve(self, request: web.Request, parse: Callable, prefix: str, chat: bool) -> web.StreamResponse:
        if (request.charset or "utf-8").lower() not in ("utf-8", "utf8"):
            raise api.RequestError(f"charset {request.charset!r} is not supported; send JSON as UTF-8", status=415,
                                   code="unsupported_media_type")
        job_id = self.node.new_job_id(prefix)
        req = await read_parsed(request, self.node.settings.max_body_bytes,
                                lambda body: parse(body, job_id, self.limits))
        request[JOB_ID] = job_id
        async with contextlib.AsyncExitStack() as stack:  # closing it cancels whatever still runs
            model, choices = await open_choices(self.node, req, stack)
            echoes = await self._echoes(req, model) if req.echo else None
            reply = _Reply(job_id, model, req, chat, echoes)
            if req.stream:
                return await self._stream(request, reply, choices)
            return await self._collect(request, reply, choices)

    async def _echoes(self, req: api.ParsedRequest, model: str) -> list[str]:
        """Each prompt's text as echoed: as sent, or its token ids decoded."""
        firsts = [req.jobs[i] for i in range(0, len(req.jobs), req.n)]
        return [j.prompt if j.prompt is not None else await self.node.detokenize(model, list(j.prompt_ids))
                for j in firsts]

    async def _collect(self, request: web.Request, reply: "_Reply", choices: list[Choice]) -> web.Response:
        results = {c.index: out.ChoiceResult(c.index, done=None) for c in choices}
        async for choice, batch, end in merged(choices):
            r = results[choice.index]
            for ev in batch:
                r.text += ev.text
                r.ids += ev.token_ids
                r.calls += ev.tool_calls
                r.logprobs += ev.logprobs
            if isinstance(end, Error):
                raise api.error_for(end.cause, end.message, end.param)
            if isinstance(end, Done):
                r.done = end
                reply.scored(choice.index, end.prompt_logprobs)
        ended = [results[i] for i in sorted(results)]
        if any(r.done is None for r in ended):
            raise api.RequestError("a job ended without a result", status=500, type_="server_error")
        request[USAGE] = out.usage_of(ended, reply.req.n)
        # Off the loop and in pieces: 64 echoed prompts' logprobs, 20 alternatives each, are tens of MB of JSON
        body = await off_loop(lambda: dumps_in_pieces(reply.whole(ended)))
        return web.Response(text=body, content_type="application/json")

    async def _stream(self, request: web.Request, reply: "_Reply", choices: list[Choice]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await resp.write(f"data: {data}\n\n".encode())

        if reply.chat:
            for c in choices:
                await send(out.chat_chunk(reply.job_id, reply.model, reply.created, index=c.index, role=True,
                                          text=""))
        calls_sent = {c.index: 0 for c in choices}
        ids: dict[int, list[int]] = {c.index: [] for c in choices}  # what a committing node's proof commits to
        ended: list[out.ChoiceResult] = []
        async for choice, batch, end in merged(choices):
            i = choice.index
            ids[i] += [t for e in batch for t in e.token_ids]
            reply.scored(i, batch[0].prompt_logprobs if batch else end.prompt_logprobs if isinstance(end, Done)
                         else None)
            if reply.echo_due(i):  # a whole prompt's logprobs: shaped and encoded off the loop, as a whole answer
                await send(await off_loop(lambda: dumps_in_pieces(reply.echo_chunk(i))))
            text = "".join(e.text for e in batch)
            lps = [lp for e in batch for lp in e.logprobs]
            if text or lps:
                await send(reply.chunk(i, text, lps))
            calls = [c for e in batch for c in e.tool_calls]
            for delta in out.tool_call_deltas(calls, calls_sent[i]):
                await send(out.chat_chunk(reply.job_id, reply.model, reply.created, index=i, tool_calls=delta))
            calls_sent[i] += len(calls)
            if isinstance(end, Error):
                await send(api.error_for(end.cause, end.message, end.param).body())
            elif isinstance(end, Done):
                ended.append(out.ChoiceResult(i, end))
                await send(reply.final(i, end) | out.proof_of(end, ids[i]))
        if len(ended) == len(choices):
            usage = out.usage_of(ended, reply.req.n)
            request[USAGE] = usage
            if reply.req.include_usage:
                first = min(ended, key=lambda r: r.index).done
                await send(out.usage_chunk(reply.job_id, reply.model, reply.created, reply.obj, usage, first))
        await send("[DONE]")
        await resp.write_eof()
        return resp


def dumps_in_pieces(value: Any, depth: int = 6) -> str:
    """json.dumps(value), its containers `depth` levels down joined here: one dumps call holds the interpreter for
    all of its work, which on another thread still stops the event loop (25.8 MiB of logprobs: 1.6 s)."""
    if depth and isinstance(value, list):
        return "[" + ", ".join(dumps_in_pieces(v, depth - 1) for v in value) + "]"
    if depth and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{json.dumps(k)}: {dumps_in_pieces(v, depth - 1)}" for k, v in value.items()) + "}"
    return json.dumps(value)


class _Reply:
    """What shapes one request's answer: its kind, its echoes, and each choice's text offsets so far."""

    def __init__(self, job_id: str, model: str, req: api.ParsedRequest, chat: bool, echoes: list[str] | None):
        self.job_id, self.model, self.req, self.chat, self.echoes = job_id, model, req, chat, echoes
        self.created = out.now()
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self._prompt_logprobs: dict[int, tuple[TokenLogprob, ...] | None] = {}  # by prompt, from its first choice
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}

    def scored(self, index: int, prompt_logprobs) -> None:
        if prompt_logprobs is not None:
            self._prompt_logprobs[index // self.req.n] = prompt_logprobs

    def _prompt_lps(self, index: int) -> list[TokenLogprob]:
        return list(self._prompt_logprobs.get(index // self.req.n) or ())

    def whole(self, results: list[out.ChoiceResult]) -> dict[str, Any]:
        if self.chat:
            return out.chat_response(self.job_id, self.model, results, self.created, self.req.n, self.req.logprobs)
        if self.echoes is not None:  # the prompt's tokens first, scored once by its first choice
            for r in results:
                r.logprobs = self._prompt_lps(r.index) + r.logprobs
        return out.completion_response(self.job_id, self.model, results, self.created, self.req.n,
                                       self.req.logprobs, self.echoes)

    def echo_due(self, index: int) -> bool:
        return self.echoes is not None and index not in self._echoed

    def echo_chunk(self, index: int) -> dict[str, Any]:
        """The echoed prompt, once (when `echo_due`), before a choice's first text (with its logprobs when they were
        asked)."""
        self._echoed.add(index)
        return self.chunk(index, self.echoes[index // self.req.n], self._prompt_lps(index) if self.req.logprobs else [])

    def chunk(self, index: int, text: str, lps: list[TokenLogprob]) -> dict[str, Any]:
        logprobs = lps if self.req.logprobs else None
        if self.chat:
            return out.chat_chunk(self.job_id, self.model, self.created, index=index, text=text, logprobs=logprobs)
        lps_json = None
        if logprobs is not None:
            echo = self.echoes[index // self.req.n] if self.echoes is not None else ""
            lps_json, self._offsets[index] = out.completion_logprobs(logprobs, echo, self._offsets.get(index, 0))
        return out.completion_chunk(self.job_id, self.model, self.created, index=index, text=text,
                                    logprobs_json=lps_json)

    def final(self, index: int, done: Done) -> dict[str, Any]:
        """A choice's finishing chunk; usage and telemetry ride on it for every client (the choice's own)."""
        reason = out.client_finish_reason(done)
        chunk = (out.chat_chunk(self.job_id, self.model, self.created, index=index, finish_reason=reason)
                 if self.chat else out.completion_chunk(self.job_id, self.model, self.created, index=index,
                                                         finish_reason=reason))
        return chunk | {"usage": done.usage.as_dict(), "telemetry": done.telemetry.as_dict()}
