"""The local OpenAI-compatible HTTP API (aiohttp). Translates HTTP <-> Job/Event; never touches MLX."""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import socket
import stat
import time
from pathlib import Path
from typing import Callable

from aiohttp import web

from .. import logs, paths
from ..jobs import JobError
from ..node import Node
from ..status_file import DaemonFacts
from . import openai_api as api
from . import chat_output as out
from . import anthropic_messages
from .anthropic_routes import AnthropicMessages
from .bodies import off_loop, read_json
from .cli_jobs import CliJobs
from .dashboard import Dashboard
from .model_controls import ModelControls
from .origin_guard import OriginGuard, over_control_socket
from .completions import JOB_ID, USAGE, Completions
from .responses_routes import Responses

log = logs.get("local")
TOKEN_FILE = "local-api-token"


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


def _error(e: api.RequestError, path: str = "") -> web.Response:
    """In the shape of the API the path belongs to: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return web.json_response(anthropic_messages.error_body(e), status=e.status)
    return web.json_response(e.body(), status=e.status)


class LocalAPI:
    def __init__(self, node: Node, token: str | None, facts: DaemonFacts | None = None):
        self.node = node
        self.token = token
        s = node.settings
        self.limits = api.Limits(s.max_tokens_limit, s.default_max_tokens)
        self.serving = Completions(node, self.limits)
        self.anthropic = AnthropicMessages(node, self.limits)
        self.responses = Responses(node, self.limits)
        self.cli_jobs = CliJobs(node)
        self.model_controls = ModelControls(node)
        self.page = Dashboard(node, token, facts)  # the node's page at / (dashboard.py)
        # The guard refuses a foreign Host or Origin on every method and route, before auth and any handler
        # (origin_guard.py); _errors renders its refusals in the route's surface's shape.
        self.guard = OriginGuard(s)
        self.app = web.Application(client_max_size=s.max_body_bytes, middlewares=[
            self._access, self._errors, self.guard.middleware, self._preflight, self._auth])
        self.app.on_response_prepare.append(self._cors_headers)
        self.app.add_routes([
            web.post("/v1/chat/completions", self.serving.chat),
            web.post("/v1/completions", self.serving.completions),
            web.post("/v1/messages", self.anthropic.create),
            web.post("/v1/messages/count_tokens", self.anthropic.count_tokens),
            web.post("/v1/responses", self.responses.create),
            web.get("/v1/responses/{response_id}", self.responses.get),
            web.delete("/v1/responses/{response_id}", self.responses.delete),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/tokenizer_info", self.tokenizer_info),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
            web.post("/provider/v1/generate", self.cli_jobs.generate),  # `provider generate` beside the daemon
            web.post("/provider/v1/generate/{job_id}/cancel", self.cli_jobs.cancel),
            web.post("/provider/v1/models/load", self.model_controls.load),  # `provider models load|unload`
            web.post("/provider/v1/models/unload", self.model_controls.unload),
            web.get("/provider/v1/status", self.status),  # `provider status`: what the snapshot file holds, now
        ])
        self.page.add_routes(self.app)

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
        carry Access-Control-Allow-Origin. The bearer token is still required on the real request. (Requests
        of every other method from another origin were refused by the guard before this.)"""
        origin = request.headers.get("Origin")
        allowed = origin is not None and origin.lower() in self.guard.cors_origins
        if request.method == "OPTIONS":
            if not allowed:
                raise api.RequestError("cross-origin requests from this origin are not enabled on this node "
                                       "(cors_origins)", status=403, code="cors_disabled", type_="permission_error")
            return web.Response(status=204, headers={
                "Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type, x-api-key, anthropic-version", "Access-Control-Max-Age": "600"})
        return await handler(request)

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        # On prepare, so streamed (SSE) answers get them too.
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() in self.guard.cors_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except api.RequestError as e:
            return _error(e, request.path)
        except JobError as e:  # the node refused what the request named (a model, a token id)
            return _error(api.error_for(e.cause, e.message, e.param), request.path)
        except web.HTTPRequestEntityTooLarge:
            limit = self.node.settings.max_body_bytes
            return _error(api.RequestError(f"request body exceeds {limit} bytes", status=413, code="body_too_large"),
                          request.path)
        except web.HTTPException as e:
            if e.status >= 400:
                return _error(api.RequestError(e.reason, status=e.status, code=str(e.status)), request.path)
            raise

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        open_paths = ("/health", "/metrics") if self.node.settings.metrics_public else ("/health",)
        # The page's paths decide for themselves, and its session cookie opens its own calls (dashboard.py).
        if self.token is not None and request.path not in open_paths and not over_control_socket(request) \
                and not self.page.admits(request):
            header = request.headers.get("Authorization", "")
            # Anthropic's clients send the key as x-api-key (anthropic-version beside it is accepted, unread).
            given = header[7:] if header.startswith("Bearer ") else request.headers.get("x-api-key", "")
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
        return web.json_response(out.health_body(st))

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.page.facts.snapshot(self.node.status()))

    async def metrics(self, request: web.Request) -> web.Response:
        # Prometheus text format (0.0.4); behind the bearer token unless metrics_public.
        body = await asyncio.to_thread(self.node.metrics.exposition)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        created = out.now()
        data = [{"id": m, "object": "model", "created": created, "owned_by": "provider"} for m in self.node.model_ids()]
        return web.json_response({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's shape: {model, prompt} or {model, messages}; {count, max_model_len, tokens}."""
        body = await read_json(request, self.node.settings.max_body_bytes)
        job, special = await off_loop(api.parse_tokenize, body, self.node.new_job_id("tok"))
        ids, context = await self.node.tokenize(job, special)
        return web.json_response({"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": None})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's shape, for ?model= (the default model when absent)."""
        return web.json_response(await self.node.tokenizer_info(request.query.get("model", "")))

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's shape: {model, tokens}; {prompt}."""
        body = await read_json(request, self.node.settings.max_body_bytes)
        model, ids = await off_loop(api.parse_detokenize, body)
        return web.json_response({"prompt": await self.node.detokenize(model, ids)})


async def _runner(node: Node, token: str | None, facts: DaemonFacts | None) -> web.AppRunner:
    runner = web.AppRunner(LocalAPI(node, token, facts).app, handler_cancellation=True, shutdown_timeout=5.0,
                           access_log=None, auto_decompress=False)  # see bodies.read_body
    await runner.setup()
    return runner


async def start_control_socket(node: Node, token: str | None, runner: web.AppRunner | None = None, *,
                               facts: DaemonFacts | None = None) -> tuple[web.AppRunner, Path | None]:
    """Serve the API on STATE/control.sock too (the TCP API's runner, or one of its own for a node without it),
    for the same user's command line (`provider generate`). Only while holding the state directory's instance
    lock: a socket file found there is a dead daemon's and is replaced. The socket is made 0600 before it
    listens. Returns the runner and the socket's path, or None (and a warning) if it could not be made."""
    runner = runner or await _runner(node, token, facts)
    path = paths.control_socket()
    sock, bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), False
    try:
        if path.is_socket():
            path.unlink()
        sock.bind(str(path))
        bound = True
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)  # before listen(): nobody can connect until it is private
        await web.SockSite(runner, sock).start()
    except OSError as e:
        sock.close()
        if bound:
            path.unlink(missing_ok=True)
        log.warning("control_socket_unavailable", path=str(path), error=str(e))
        return runner, None
    log.info("control_socket_listening", path=str(path))
    return runner, path


async def start_local_api(node: Node, bind: str, port: int, token: str | None, runner: web.AppRunner | None = None,
                          *, facts: DaemonFacts | None = None) -> tuple[web.AppRunner, str]:
    """Start listening (on `runner`, the control socket's, if it is already set up); return the runner (call
    `cleanup()` after the node stopped) and the base URL."""
    runner = runner or await _runner(node, token, facts)
    site = web.TCPSite(runner, bind, port)
    await site.start()
    sock = site._server.sockets[0].getsockname()  # the real port when port=0
    host = f"[{sock[0]}]" if ":" in sock[0] else sock[0]
    url = f"http://{host}:{sock[1]}"
    log.info("local_api_listening", url=url, auth=token is not None)
    return runner, url
