"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API served by the one job path,
with a bounded store of responses for previous_response_id."""

from __future__ import annotations

from aiohttp import web

from ..jobs import Done, Error
from ..node import Node
from . import openai_api as api
from . import responses_output as out
from .agent_edge import collected, failed, run_job
from .bodies import parse_json, read_body
from .openai_responses import now
from .responses_api import ResponsesRequest, parse_responses
from .responses_store import ResponseStore

MAX_ID_CHARS = 128


class Responses:
    def __init__(self, node: Node, limits: api.Limits, store: ResponseStore | None = None):
        self.node = node
        self.limits = limits
        self.store = store or ResponseStore()

    def _stored(self, response_id: str, param: str | None = None):
        entry = self.store.get(response_id) if len(response_id) <= MAX_ID_CHARS else None
        if entry is None:
            raise api.RequestError(f"no stored response {response_id[:MAX_ID_CHARS]!r} (never stored, deleted, or "
                                   "dropped by the store's bounds)", param, status=404 if param is None else 400,
                                   code="response_not_found")
        return entry

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self._stored(request.match_info["response_id"]).body)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        self._stored(response_id)
        self.store.delete(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = parse_json(await read_body(request, self.node.settings.max_body_bytes))
        prior: tuple[dict, ...] = ()
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            previous = body["previous_response_id"]
            if not isinstance(previous, str):
                raise api.RequestError("previous_response_id must be a string", "previous_response_id")
            prior = self._stored(previous, "previous_response_id").items
        job_id = self.node.new_job_id("resp")
        req = parse_responses(body, job_id, self.limits, prior)
        resp_id = job_id.replace("-", "_")
        async with run_job(self.node, request, req.job, req.notes, tools=req.tools) as (model, events):
            events_out = out.ResponseEvents(resp_id, model, now(), req.echo, req.notes)
            if req.stream:
                return await self._stream(request, req, events_out, events)
            text, calls, end = await collected(events)
            items = out.output_items(resp_id, text, calls)
            body = out.response_object(resp_id, model, events_out.created, req.echo, items, end, req.notes)
            self._keep(req, resp_id, items, body)
            return web.json_response(body)

    def _keep(self, req: ResponsesRequest, resp_id: str, items: list[dict], body: dict) -> None:
        if req.store:
            self.store.put(resp_id, req.items + out.as_input(items), body)

    async def _stream(self, request: web.Request, req: ResponsesRequest, events_out: out.ResponseEvents,
                      events) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for e in events_out.start():
            await resp.write(out.sse(e))
        async for batch, end in events:
            chunk = []
            for ev in batch:
                chunk += events_out.delta(ev.text)
                for call in ev.tool_calls:
                    chunk += events_out.call(call)
            if isinstance(end, Done):
                closing, body = events_out.end(end)
                chunk += closing
                self._keep(req, events_out.resp_id, events_out.items, body)
            elif isinstance(end, Error):
                e = failed(end)
                chunk += events_out.failed(e.code or e.type, e.message, e.param)
            if chunk:
                await resp.write(b"".join(out.sse(e) for e in chunk))
        await resp.write_eof()
        return resp
