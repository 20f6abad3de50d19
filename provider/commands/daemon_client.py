"""The running daemon, as the command line reaches it: HTTP over its control socket (STATE/control.sock, 0600),
which the daemon serves whether or not it listens on TCP (provider/local/server.py `start_control_socket`).
Only the owner of the state directory can connect, so no token is sent.

`call` is one request and its JSON answer; `stream_generate` is a `provider generate` job, read event by event
(`POST /provider/v1/generate`, provider/local/cli_jobs.py). aiohttp is imported by the calls, not with the module:
when no daemon runs, `provider generate` never talks HTTP (aiohttp and the TLS contexts it builds on import are
~0.1-0.2 s of a one-shot start, issue 57)."""

from __future__ import annotations

import json as jsonlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from .. import paths

if TYPE_CHECKING:
    import aiohttp

BASE = "http://provider"  # the host is not looked up: the connector always dials the socket
CONNECT_TIMEOUT_S = 10.0
READ_BUFSIZE = 2**20  # an event of the stream (a batch of tokens, the job's end) may be twice this long
# An answer without the cause field (refused before the route ran: a body too large, a wrong method): its cause.
STATUS_CAUSE = {400: "invalid_request", 404: "invalid_request", 405: "invalid_request", 413: "invalid_request",
                415: "invalid_request", 429: "overloaded", 503: "draining"}


class Unreachable(Exception):
    """Nothing answers on the control socket: no file there, or nobody listening (a daemon stopped, or one from
    before the socket existed)."""


def _session(socket: Path | None, timeout: float | None) -> aiohttp.ClientSession:
    import aiohttp

    connector = aiohttp.UnixConnector(path=str(socket or paths.control_socket()))
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
        total=timeout, sock_connect=CONNECT_TIMEOUT_S), read_bufsize=READ_BUFSIZE)


async def call(method: str, path: str, json: Any = None, *, socket: Path | None = None,
               timeout: float | None = None) -> tuple[int, Any]:
    """One request to the daemon: its HTTP status and its body (parsed JSON, else text). Unreachable when nothing
    answers on the socket; `timeout` (seconds, None: none) bounds the whole call."""
    import aiohttp

    try:
        async with _session(socket, timeout) as session:
            async with session.request(method, BASE + path, json=json) as r:
                raw = await r.read()
                try:
                    return r.status, jsonlib.loads(raw)
                except ValueError:
                    return r.status, raw.decode("utf-8", "replace")
    except aiohttp.ClientConnectorError as e:
        raise Unreachable(str(e.os_error)) from None


async def stream_generate(body: dict[str, Any], *, socket: Path | None = None) -> AsyncIterator[dict[str, Any]]:
    """Run a generate job (the JSON shape of provider/generate_job.py) in the daemon. Yields {"accepted": {job_id,
    model}} once the daemon took the job, {"tokens": text} as they come, then exactly one of {"done": {finish_reason,
    usage, telemetry}} or {"error": {cause, message, param}}: a refusal, an answer cut short and a daemon that
    went away all end as an error event. Unreachable if nothing answers. Closing the generator early (or the
    process ending) hangs up, which cancels the job in the daemon."""
    import aiohttp

    try:
        async with _session(socket, None) as session:
            async with session.post(BASE + "/provider/v1/generate", json=body) as r:
                if r.status != 200:
                    yield _refusal(r.status, await r.read())
                    return
                async for line in r.content:
                    if not line.strip():
                        continue
                    try:
                        event = jsonlib.loads(line)
                    except ValueError:
                        event = None
                    if not isinstance(event, dict) or len(event) != 1:
                        yield _error("internal", f"the daemon sent what is not an event: {line[:80]!r}")
                        return
                    yield event
                    if "done" in event or "error" in event:
                        return
    except aiohttp.ClientConnectorError as e:
        raise Unreachable(str(e.os_error)) from None
    except (aiohttp.ClientError, ConnectionError, ValueError) as e:  # ValueError: a line longer than the buffer
        yield _error("internal", f"the daemon closed the connection before the job ended ({e or type(e).__name__})")
        return
    yield _error("internal", "the daemon ended the answer before the job ended")


def _error(cause: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"cause": cause, "message": message, "param": param}}


def _refusal(status: int, raw: bytes) -> dict[str, Any]:
    """A refused job's error event: the route's own {"error": {cause, message}}, or what aiohttp or a middleware
    answered (OpenAI's error shape, or text)."""
    try:
        err = jsonlib.loads(raw).get("error")
    except (ValueError, AttributeError):
        err = None
    if not isinstance(err, dict):
        return _error(STATUS_CAUSE.get(status, "internal"), f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}")
    cause = err.get("cause") if isinstance(err.get("cause"), str) else STATUS_CAUSE.get(status, "internal")
    return _error(cause, str(err.get("message", f"HTTP {status}")), err.get("param"))
