"""The command line's jobs in the daemon: `provider generate` beside a running daemon sends its job here over the
control socket (provider/commands/daemon_client.py) instead of loading a second engine.

POST /provider/v1/generate takes the job's JSON (provider/generate_job.py, checked by the same `job_of` as the
command's own) and answers NDJSON, one event a line: {"accepted": {job_id, model}}, {"tokens": text} as they
come, then exactly one of {"done": {finish_reason, usage, telemetry}} or {"error": {cause, message, param}}. A
request refused before it runs is an HTTP error status with that same {"error": ...} body. Ctrl-C in the command
is POST /provider/v1/generate/{job_id}/cancel (the job then ends with finish `cancelled`, its telemetry sent as
for any job); a client that hangs up has its job cancelled too (the runner cancels a handler whose connection
is lost, which closes the job's stream)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from aiohttp import web

from ..generate_job import job_of
from ..outputs import Done, Error, Tokens
from ..node import Node
from ..types import Cause, JobError
from . import openai_api as api
from .bodies import off_loop, read_json
from .completions import JOB_ID, USAGE

NDJSON = "application/x-ndjson"


def _error_body(cause: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"cause": cause, "message": message, "param": param}}


def _refused(cause: Cause, message: str, param: str | None = None, status: int | None = None) -> web.Response:
    return web.json_response(_error_body(cause.value, message, param),
                             status=status or api.CAUSE_STATUS.get(cause, (500, ""))[0])


class CliJobs:
    def __init__(self, node: Node):
        self.node = node
        self.live: set[str] = set()  # the jobs this route runs: the only ones its cancel may touch

    async def generate(self, request: web.Request) -> web.StreamResponse:
        settings = self.node.settings
        try:
            body = await read_json(request, settings.max_body_bytes)
            job = await off_loop(job_of, body, self.node.new_job_id("gen"), settings.max_tokens_limit)
            job = dataclasses.replace(job, model=self.node.resolve_model(job.model))
        except api.RequestError as e:  # not JSON, not UTF-8, a bad encoding
            return _refused(Cause.INVALID_REQUEST, e.message, e.param, e.status)
        except JobError as e:  # a bad field, an unknown model
            return _refused(e.cause, e.message, e.param)
        request[JOB_ID] = job.id
        resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await resp.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")

        self.live.add(job.id)
        try:
            async with self.node.run(job) as stream:  # leaving it early (a hang-up) cancels the job
                await send({"accepted": {"job_id": job.id, "model": job.model}})
                async for ev in stream:
                    end = ev
                    if isinstance(ev, Tokens):
                        batch, end = await stream.coalesce(ev)
                        text = "".join(t.text for t in batch)
                        if text:
                            await send({"tokens": text})
                    if isinstance(end, Done):
                        request[USAGE] = end.usage
                        await send({"done": {"finish_reason": end.finish_reason.value, "usage": end.usage.as_dict(),
                                             "telemetry": end.telemetry.as_dict()}})
                    elif isinstance(end, Error):
                        await send(_error_body(end.cause.value, end.message, end.param))
            await resp.write_eof()
        except ConnectionResetError:  # the client went away mid-write: its job was cancelled on the way out
            pass
        finally:
            self.live.discard(job.id)
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        if job_id not in self.live:
            return _refused(Cause.INVALID_REQUEST, f"no job {job_id[:80]!r} of the command line runs here", "job_id",
                            404)
        self.node.cancel(job_id)
        return web.json_response({"cancelled": job_id}, status=202)
