"""The local OpenAI-compatible HTTP API (aiohttp). Translates HTTP <-> Job/Event; never touches MLX."""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
import zlib
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from .. import logs, paths
from ..jobs import Accepted, Done, Error, Tokens, Usage
from ..types import Cause
from ..node import JobStream, Node
from . import openai_api as api

log = logs.get("local")
TOKEN_FILE = "local-api-token"
# What the access line reports of a request that ran a job.
JOB_ID = web.RequestKey("job_id", str)
USAGE = web.RequestKey("usage", Usage)


def load_or_mint_token(state_dir: Path | None = None) -> tuple[str, Path]:
    """The bearer token for the local API, minted on first use into a 0600 file."""
    path = (state_dir or paths.state_dir()) / TOKEN_FILE
    if path.exists():
        if not paths.is_private(path):
            raise PermissionError(f"{path} is readable by other users; run `chmod 600 {path}` or delete it")
        token = path.read_text().strip()
        if token:
            return token, path
    token = "sk-local-" + secrets.token_urlsafe(32)
    paths.write_private(path, token.encode())
    return token, path


def _error(e: api.RequestError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


class LocalAPI:
    def __init__(self, node: Node, token: str | None):
        self.node = node
        self.token = token
        s = node.settings
        self.limits = api.Limits(s.max_tokens_limit, s.default_max_tokens)
        self.app = web.Application(client_max_size=s.max_body_bytes,
                                   middlewares=[self._access, self._errors, self._preflight, self._auth])
        self.app.on_response_prepare.append(self._cors_headers)
        self.app.add_routes([
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])

    # --- middlewares ----------------------------------------------------------------

    @web.middleware
    async def _access(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """One line per request: method, path, status, duration, and the job's id and token counts if it ran
        one. Never the prompt or the completion."""
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            usage = request.get(USAGE)
            log.info("http_request", method=request.method, path=request.path, status=status,
                     duration_ms=round((time.perf_counter() - started) * 1000, 3), job_id=request.get(JOB_ID),
                     prompt_tokens=usage.prompt_tokens if usage else None,
                     completion_tokens=usage.completion_tokens if usage else None)

    @web.middleware
    async def _preflight(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """CORS: off unless `cors_origins` names the origin. A preflight gets 204 with the allowed methods and
        headers, or a clear 403 (never the 401 meant for a missing token); answers to an allowed origin
        carry Access-Control-Allow-Origin. The bearer token is still required on the real request."""
        origin = request.headers.get("Origin")
        allowed = origin is not None and origin in self.node.settings.cors_origin_list
        if request.method == "OPTIONS":
            if not allowed:
                raise api.RequestError("cross-origin requests from this origin are not enabled on this node "
                                       "(cors_origins)", status=403, code="cors_disabled", type_="permission_error")
            return web.Response(status=204, headers={
                "Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600"})
        return await handler(request)

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        # On prepare, so streamed (SSE) answers get them too.
        origin = request.headers.get("Origin")
        if origin is not None and origin in self.node.settings.cors_origin_list:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except api.RequestError as e:
            return _error(e)
        except web.HTTPRequestEntityTooLarge:
            limit = self.node.settings.max_body_bytes
            return _error(api.RequestError(f"request body exceeds {limit} bytes", status=413, code="body_too_large"))
        except web.HTTPException as e:
            if e.status >= 400:
                return _error(api.RequestError(e.reason, status=e.status, code=str(e.status)))
            raise

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        open_paths = ("/health", "/metrics") if self.node.settings.metrics_public else ("/health",)
        if self.token is not None and request.path not in open_paths:
            header = request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else ""
            # aiohttp keeps undecodable header bytes as surrogates: encode them back, never raise on them.
            if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.token.encode()):
                raise api.RequestError("missing or wrong bearer token; see the token file printed at start-up",
                                       status=401, code="invalid_api_key", type_="authentication_error")
        return await handler(request)

    # --- routes --------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        st = self.node.status()
        if st.health == "unhealthy":  # the supervisor restarts the process; until then, say so
            return web.json_response({"status": "unhealthy", "reason": st.failure}, status=503)
        return web.json_response(api.health_body(st))

    async def metrics(self, request: web.Request) -> web.Response:
        # Prometheus text format (0.0.4); behind the bearer token unless metrics_public.
        body = await asyncio.to_thread(self.node.metrics.exposition)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        created = api.now()
        data = [{"id": m, "object": "model", "created": created, "owned_by": "provider"} for m in self.node.model_ids()]
        return web.json_response({"object": "list", "data": data})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api.parse_chat, "chatcmpl", chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, api.parse_completion, "cmpl", chat=False)

    async def _serve(self, request: web.Request, parse: Callable, prefix: str, chat: bool) -> web.StreamResponse:
        if (request.charset or "utf-8").lower() not in ("utf-8", "utf8"):
            raise api.RequestError(f"charset {request.charset!r} is not supported; send JSON as UTF-8", status=415,
                                   code="unsupported_media_type")
        body = _parse_json(await _read_body(request, self.node.settings.max_body_bytes))
        req = parse(body, self.node.new_job_id(prefix), self.limits)
        job = req.job
        request[JOB_ID] = job.id
        async with self.node.run(job) as stream:
            first = await anext(stream)
            if isinstance(first, Error):
                raise api.error_for(first.cause, first.message, first.param)
            if not isinstance(first, Accepted):  # ended before it started: only a cancel does that
                raise api.error_for(Cause.DRAINING, "the job was cancelled before it started; retry")
            if req.stream:
                return await self._stream(request, stream, job.id, first.model, chat, req.include_usage)
            return await self._collect(request, stream, job.id, first.model, chat)

    async def _collect(self, request: web.Request, stream: JobStream, job_id: str, model: str,
                       chat: bool) -> web.Response:
        parts: list[str] = []
        calls = []
        async for ev in stream:
            if isinstance(ev, Tokens):
                parts.append(ev.text)
                calls += ev.tool_calls
            elif isinstance(ev, Error):
                raise api.error_for(ev.cause, ev.message, ev.param)
            elif isinstance(ev, Done):
                request[USAGE] = ev.usage
                if chat:
                    return web.json_response(api.chat_response(job_id, model, "".join(parts), ev, api.now(), calls))
                return web.json_response(api.completion_response(job_id, model, "".join(parts), ev, api.now()))
        raise api.RequestError("the job ended without a result", status=500, type_="server_error")

    async def _stream(self, request: web.Request, stream: JobStream, job_id: str, model: str, chat: bool,
                      include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = api.now()
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await resp.write(f"data: {data}\n\n".encode())

        if chat:
            await send(api.chat_chunk(job_id, model, created, role=True, text=""))
        calls_sent = 0
        async for ev in stream:
            # Coalesce whatever else is already waiting, so a slow client never falls behind per token.
            batch, end = await stream.coalesce(ev) if isinstance(ev, Tokens) else ([], ev)
            text = "".join(e.text for e in batch)
            if text:
                chunk = (api.chat_chunk(job_id, model, created, text=text) if chat
                         else api.completion_chunk(job_id, model, created, text=text))
                await send(chunk)
            calls = [c for e in batch for c in e.tool_calls]
            for delta in api.tool_call_deltas(calls, calls_sent):
                await send(api.chat_chunk(job_id, model, created, tool_calls=delta))
            calls_sent += len(calls)
            if isinstance(end, Error):
                await send(api.error_for(end.cause, end.message, end.param).body())
            elif isinstance(end, Done):
                request[USAGE] = end.usage
                final = (api.chat_chunk(job_id, model, created, finish_reason=end.finish_reason) if chat
                         else api.completion_chunk(job_id, model, created, finish_reason=end.finish_reason))
                # usage + telemetry ride on the finishing chunk for every client, and on an
                # extra choices-less chunk for clients that asked for include_usage.
                final |= {"usage": end.usage.as_dict(), "telemetry": end.telemetry.as_dict()}
                await send(final)
                if include_usage:
                    await send(api.usage_chunk(job_id, model, created, obj, end))
        await send("[DONE]")
        await resp.write_eof()
        return resp


# wbits for zlib: gzip, zlib-wrapped deflate (RFC 9110), and the raw deflate some clients send instead.
_DECODINGS = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,),
              "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, decoded here rather than in aiohttp's parser (whose errors on a bad body escape the
    handler as plain-text 400s, or hang the request), and never inflated past the body limit."""
    raw = await request.read()  # at most client_max_size bytes, as sent
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _DECODINGS:
        raise api.RequestError(f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or none",
                               status=415, code="unsupported_media_type")
    for wbits in _DECODINGS[encoding]:
        inflater = zlib.decompressobj(wbits)
        try:
            body = inflater.decompress(raw, limit + 1)
        except zlib.error:
            continue
        if len(body) > limit:
            raise api.RequestError(f"request body exceeds {limit} bytes once decompressed", status=413,
                                   code="body_too_large")
        if inflater.eof and not inflater.unused_data:
            return body
    raise api.RequestError(f"the request body is not valid {encoding} data; check its Content-Encoding")


def _parse_json(raw: bytes) -> Any:
    """JSON is UTF-8 (RFC 8259). NaN and Infinity, which json.loads accepts by default, are refused; so is
    nesting deep enough to exhaust the stack."""
    def bad_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=bad_constant)
    except UnicodeDecodeError as e:
        raise api.RequestError(f"the request body is not UTF-8 (byte {e.start}); send JSON as UTF-8") from None
    except RecursionError:
        raise api.RequestError("the request body is nested too deeply") from None
    except ValueError as e:
        raise api.RequestError(f"the request body is not valid JSON: {e}") from None


async def start_local_api(node: Node, bind: str, port: int, token: str | None) -> tuple[web.AppRunner, str]:
    """Start listening; return the runner (call `cleanup()` after the node stopped) and the base URL."""
    runner = web.AppRunner(LocalAPI(node, token).app, handler_cancellation=True, shutdown_timeout=5.0,
                           access_log=None, auto_decompress=False)  # see _read_body
    await runner.setup()
    site = web.TCPSite(runner, bind, port)
    await site.start()
    sock = site._server.sockets[0].getsockname()  # the real port when port=0
    host = f"[{sock[0]}]" if ":" in sock[0] else sock[0]
    url = f"http://{host}:{sock[1]}"
    log.info("local_api_listening", url=url, auth=token is not None)
    return runner, url
