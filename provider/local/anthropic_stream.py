"""Anthropic's streamed Message: the job's events as Anthropic's server-sent events, in its order
(message_start, ping, per block content_block_start / content_block_delta / content_block_stop, message_delta
with stop_reason and usage, message_stop; an `error` event if the job fails once begun). Pure: builds the
events; anthropic_routes writes them."""

from __future__ import annotations

import json
from typing import Any

from ..outputs import Done, ToolCall
from . import anthropic_messages as am
from .agent_edge import EdgeNotes


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


class MessageEvents:
    """One message's events, fed the job's text and calls as they come."""

    def __init__(self, msg_id: str, model: str):
        self.msg_id, self.model = msg_id, model
        self.index = -1  # the current block's
        self.open: str | None = None  # "text" | "tool_use" while a block is open

    def start(self) -> list[dict[str, Any]]:
        message = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": am.usage(None)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out = []
        if self.open != "text":
            out += self._close()
            self.index += 1
            self.open = "text"
            out.append({"type": "content_block_start", "index": self.index,
                        "content_block": {"type": "text", "text": ""}})
        return out + [{"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "text_delta", "text": text}}]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        """A whole call: its block opened with id and name, its input as one input_json_delta, closed."""
        out = self._close()
        self.index += 1
        block = {"type": "tool_use", "id": am.tool_use_id(call), "name": call.name, "input": {}}
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        out.append({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": call.arguments or "{}"}})
        self.open = "tool_use"
        return out + self._close()

    def end(self, done: Done, notes: EdgeNotes) -> list[dict[str, Any]]:
        out = self._close()
        if self.index < 0:  # an empty answer is still one (empty) text block, as Anthropic sends it
            out += [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                    {"type": "content_block_stop", "index": 0}]
        reason, sequence = am.stop_reason(done)
        out.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": am.usage(done), "telemetry": notes.telemetry(done)})
        return out + [{"type": "message_stop"}]
