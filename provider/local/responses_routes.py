"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API served by the one job path,
with a bounded store of responses for previous_response_id.

A chain of previous_response_id is bounded as one request is: the stored conversation and the new body together
hold at most MAX_JSON_VALUES values and max_body_bytes bytes, checked before the stored conversation is parsed
(left-out items, `reasoning` and unknown types, cost the prompt nothing but were stored and parsed again on
every turn: 12 chained 2 MB requests reached 1.2 M items)."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from ..outputs import Done, Error
from ..node import Node
from . import openai_api as api
from . import responses_output as out
from .agent_edge import collected, failed, kept_alive, run_job
from .bodies import Body, off_loop, parse_bounded, read_body
from .json_bounds import MAX_JSON_VALUES
from .chat_output import now
from .responses_api import ResponsesRequest, parse_responses
from .responses_store import ResponseStore, Stored, compact, joined

MAX_ID_CHARS = 128


class Responses:
    def __init__(self, node: Node, limits: api.Limits, store: ResponseStore | None = None):
        self.node = node
        self.limits = limits
        self.store = store or ResponseStore(on_change=node.book_responses)

    def _stored(self, response_id: str, param: str | None = None):
        entry = self.store.get(response_id) if len(response_id) <= MAX_ID_CHARS else None
        if entry is None:
            raise api.RequestError(f"no stored response {response_id[:MAX_ID_CHARS]!r} (never stored, deleted, or "
                                   "dropped by the store's bounds)", param, status=404 if param is None else 400,
                                   code="response_not_found")
        return entry

    async def get(self, request: web.Request) -> web.Response:
        return web.Response(body=self._stored(request.match_info["response_id"]).body,
                            content_type="application/json")

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        self._stored(response_id)
        self.store.delete(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        raw = await read_body(request, self.node.settings.max_body_bytes)
        job_id = self.node.new_job_id("resp")
        req, conversation = await off_loop(self._request, raw, job_id)
        resp_id = job_id.replace("-", "_")
        async with run_job(self.node, request, req.job, req.notes, tools=req.tools) as (model, events):
            events_out = out.ResponseEvents(resp_id, model, now(), req.echo, req.notes)
            if req.stream:
                return await self._stream(request, req, conversation, events_out, events)
            text, calls, end = await collected(events)
            items = out.output_items(resp_id, text, calls)
            body = out.response_object(resp_id, model, events_out.created, req.echo, items, end, req.notes)
            await self._keep(req, resp_id, conversation, items, body)
            return web.json_response(body)

    def _request(self, raw: bytes, job_id: str) -> tuple[ResponsesRequest, bytes]:
        """On the parser thread: the request as a job over the stored conversation it continues, and that
        conversation with this input as compact JSON. The parsed values go no further (the loop never frees them,
        nor does its collector walk them while the job runs)."""
        body = parse_bounded(raw)
        entry = None
        if isinstance(body.value, dict) and body.value.get("previous_response_id") is not None:
            previous = body.value["previous_response_id"]
            if not isinstance(previous, str):
                raise api.RequestError("previous_response_id must be a string", "previous_response_id")
            entry = self._stored(previous, "previous_response_id")
            self._check_chain(entry, body)
        prior = () if entry is None else tuple(parse_bounded(entry.items, what="the stored conversation").value)
        req = parse_responses(body.value, job_id, self.limits, prior)
        sent = compact(req.items[len(prior):])
        return dataclasses.replace(req, items=[]), sent if entry is None else joined(entry.items, sent)

    def _check_chain(self, entry: Stored, body: Body) -> None:
        limit = self.node.settings.max_body_bytes
        values, size = entry.values + body.values, len(entry.items) + body.size
        if values > MAX_JSON_VALUES or size > limit:
            raise api.RequestError(
                f"the conversation behind previous_response_id and this input hold {values} JSON values and keys "
                f"in {size} bytes, more than one request may ({MAX_JSON_VALUES} values, {limit} bytes); send the "
                "conversation anew, shortened", "previous_response_id", status=413, code="conversation_too_large")

    async def _keep(self, req: ResponsesRequest, resp_id: str, conversation: bytes, items: list[dict],
                    body: dict) -> None:
        if req.store:
            await off_loop(lambda: self.store.put(resp_id, joined(conversation, compact(out.as_input(items))), body))

    async def _stream(self, request: web.Request, req: ResponsesRequest, conversation: bytes,
                      events_out: out.ResponseEvents, events) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for e in events_out.start():
            await resp.write(out.sse(e))
        async for item in kept_alive(events):
            if item is None:  # a long prompt still being read: the response, still in progress, said again
                await resp.write(b"".join(out.sse(e) for e in events_out.still()))
                continue
            batch, end = item
            chunk = []
            for ev in batch:
                chunk += events_out.delta(ev.text)
                for call in ev.tool_calls:
                    chunk += events_out.call(call)
            if isinstance(end, Done):
                closing, body = events_out.end(end)
                chunk += closing
                await self._keep(req, events_out.resp_id, conversation, events_out.items, body)
            elif isinstance(end, Error):
                e = failed(end)
                chunk += events_out.failed(e.code or e.type, e.message, e.param)
            if chunk:
                await resp.write(b"".join(out.sse(e) for e in chunk))
        await resp.write_eof()
        return resp

