"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API served by the one job path."""

from __future__ import annotations

from aiohttp import web

from ..outputs import Done, Error
from ..node import Node
from . import anthropic_messages as am
from . import openai_api as api
from .agent_edge import collected, failed, kept_alive, run_job
from .anthropic_stream import MessageEvents, sse
from .bodies import read_parsed


class AnthropicMessages:
    def __init__(self, node: Node, limits: api.Limits):
        self.node = node
        self.limits = limits

    async def _parse(self, request: web.Request, counting: bool = False) -> am.MessagesRequest:
        job_id = self.node.new_job_id("msg")
        return await read_parsed(request, self.node.settings.max_body_bytes,
                                 lambda body: am.parse_messages(body, job_id, self.limits, counting=counting))

    async def count_tokens(self, request: web.Request) -> web.Response:
        req = await self._parse(request, counting=True)
        ids, _ = await self.node.tokenize(req.job)
        return web.json_response({"input_tokens": len(ids)})

    async def create(self, request: web.Request) -> web.StreamResponse:
        req = await self._parse(request)
        msg_id = req.job.id.replace("-", "_")
        async with run_job(self.node, request, req.job, req.notes, tools=req.tools) as (model, events):
            if req.stream:
                return await self._stream(request, req, msg_id, model, events)
            text, calls, end = await collected(events)
            return web.json_response(am.message_body(msg_id, model, text, calls, end, req.notes))

    async def _stream(self, request: web.Request, req: am.MessagesRequest, msg_id: str, model: str,
                      events) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        out = MessageEvents(msg_id, model)
        for e in out.start():
            await resp.write(sse(e))
        async for item in kept_alive(events):
            if item is None:  # a long prompt still being read: Anthropic's keepalive, so the client waits
                await resp.write(sse({"type": "ping"}))
                continue
            batch, end = item
            chunk = []
            for ev in batch:
                chunk += out.text(ev.text)
                for call in ev.tool_calls:
                    chunk += out.call(call)
            if isinstance(end, Done):
                chunk += out.end(end, req.notes)
            elif isinstance(end, Error):
                chunk.append(am.error_body(failed(end)))
            if chunk:
                await resp.write(b"".join(sse(e) for e in chunk))
        await resp.write_eof()
        return resp
