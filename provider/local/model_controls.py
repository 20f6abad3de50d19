"""The local API's model controls: load a model ahead of work, unload it and give its memory back. What
`provider models load|unload` sends the live daemon over its control socket, and what a script may send over
the TCP API with its token.

POST /provider/v1/models/load    {"model": ID, "keep_alive": "10m" | seconds | -1 | 0}  -> the model's residency
POST /provider/v1/models/unload  {"model": ID}  -> {"model", "state": unloaded | unloading | not_loaded}
Errors are OpenAI-shaped: unknown model 404, pinned model or bad keep_alive 400, no room 503.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from ..node import Node
from ..status import ModelStatus
from ..types import JobError
from . import openai_api as api
from .bodies import parse_json, read_body

MAX_BODY = 64 * 1024


def residency_body(m: ModelStatus) -> dict[str, Any]:
    """A model as these routes and `provider status` show it: state, bytes held, how long it stays."""
    keep = {f: getattr(m, f) for f in ("state", "pinned", "keep_alive_s", "unload_at", "active_jobs", "bytes",
                                        "load_seconds")}
    return {"model": m.id, **keep}


class ModelControls:
    def __init__(self, node: Node):
        self.node = node

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            status = await self.node.load_model(self._model(body), body.get("keep_alive"))
        except JobError as e:
            raise api.error_for(e.cause, e.message, e.param or "model") from None
        return web.json_response(residency_body(status))

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            model_id = self.node.resolve_model(self._model(body))
            state = await self.node.unload_model(model_id)
        except JobError as e:
            raise api.error_for(e.cause, e.message, e.param or "model") from None
        return web.json_response({"model": model_id, "state": state,
                                  "memory": dataclasses.asdict(self.node.status().memory)})

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        body = parse_json(await read_body(request, MAX_BODY))
        if not isinstance(body, dict):
            raise api.RequestError("the body must be a JSON object: {\"model\": ID}")
        unknown = set(body) - {"model", "keep_alive"}
        if unknown:
            raise api.RequestError(f"unknown field(s) {', '.join(sorted(unknown))[:200]}; allowed: model, keep_alive",
                                   sorted(unknown)[0][:64])
        return body

    @staticmethod
    def _model(body: dict[str, Any]) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model or len(model) > 256:
            raise api.RequestError("model must be a model id of 1 to 256 characters (see GET /v1/models)", "model")
        return model
