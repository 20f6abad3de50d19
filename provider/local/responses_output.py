"""The Responses API's answers: the response object, its output items and usage, and the typed stream events
(response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / .done, response.function_call_arguments.delta / .done, response.content_part.done,
response.output_item.done, response.completed or response.incomplete; `error` and response.failed if the job
fails once begun). Pure: no I/O."""

from __future__ import annotations

import json
from typing import Any

from ..outputs import Done, ToolCall
from ..types import FinishReason
from .agent_edge import EdgeNotes


def usage(done: Done | None) -> dict[str, Any] | None:
    if done is None:
        return None
    u = done.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def response_object(resp_id: str, model: str, created: int, echo: dict[str, Any], output: list[dict[str, Any]],
                    done: Done | None, notes: EdgeNotes, status: str | None = None,
                    error: dict | None = None) -> dict[str, Any]:
    incomplete = done is not None and done.finish_reason in (FinishReason.LENGTH, FinishReason.CANCELLED)
    if status is None:
        status = "in_progress" if done is None else "incomplete" if incomplete else "completed"
    return {"id": resp_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": usage(done), "telemetry": notes.telemetry(done)} | echo


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
        else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}


def output_items(resp_id: str, text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    items = [message_item(message_id(resp_id), text)] if text or not calls else []
    return items + [call_item(c) for c in calls]


def message_id(resp_id: str) -> str:
    return "msg_" + resp_id.removeprefix("resp_")


def as_input(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the next request's input items (what previous_response_id stands for)."""
    out = []
    for it in items:
        if it["type"] == "message":
            out.append({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": c["text"]} for c in it["content"]]})
        else:
            out.append({k: it[k] for k in ("type", "call_id", "name", "arguments")})
    return out


class ResponseEvents:
    """One streamed response's events, numbered in order, fed the job's text and calls as they come."""

    def __init__(self, resp_id: str, model: str, created: int, echo: dict[str, Any], notes: EdgeNotes):
        self.resp_id, self.model, self.created, self.echo, self.notes = resp_id, model, created, echo, notes
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self.text: list[str] | None = None  # the open message's text, while one is open
        self.calls: list[ToolCall] = []

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq} | fields
        self.seq += 1
        return ev

    def _response(self, done: Done | None, status: str | None = None, error: dict | None = None) -> dict:
        return response_object(self.resp_id, self.model, self.created, self.echo, list(self.items), done,
                               self.notes, status, error)

    def start(self) -> list[dict[str, Any]]:
        return [self._ev("response.created", response=self._response(None)),
                self._ev("response.in_progress", response=self._response(None))]

    def still(self) -> list[dict[str, Any]]:
        """A keepalive: `response.in_progress` again (the Responses API has no ping; clients such as Codex reset
        their idle timer on any event and ignore what they have already seen)."""
        return [self._ev("response.in_progress", response=self._response(None))]

    def delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out = []
        item_id, index = message_id(self.resp_id), len(self.items)
        if self.text is None:
            self.text = []
            out.append(self._ev("response.output_item.added", output_index=index,
                                item=message_item(item_id, "", "in_progress")))
            out.append(self._ev("response.content_part.added", item_id=item_id, output_index=index,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.text.append(text)
        return out + [self._ev("response.output_text.delta", item_id=item_id, output_index=index, content_index=0,
                               delta=text, logprobs=[])]

    def _close_text(self) -> list[dict[str, Any]]:
        if self.text is None:
            return []
        text, self.text = "".join(self.text), None
        item_id, index = message_id(self.resp_id), len(self.items)
        item = message_item(item_id, text)
        self.items.append(item)
        part = item["content"][0]
        return [self._ev("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                         text=text, logprobs=[]),
                self._ev("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                         part=part),
                self._ev("response.output_item.done", output_index=index, item=item)]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        out = self._close_text()
        index, item = len(self.items), call_item(call)
        out.append(self._ev("response.output_item.added", output_index=index, item=call_item(call, "in_progress")))
        out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=call.arguments))
        out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=call.name, arguments=call.arguments))
        self.items.append(item)
        return out + [self._ev("response.output_item.done", output_index=index, item=item)]

    def end(self, done: Done) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events, and the response object as completed."""
        out = self._close_text()
        if not self.items:  # an empty answer is still one (empty) message
            item = message_item(message_id(self.resp_id), "")
            out += [self._ev("response.output_item.added", output_index=0,
                             item=message_item(item["id"], "", "in_progress")),
                    self._ev("response.output_item.done", output_index=0, item=item)]
            self.items.append(item)
        body = self._response(done)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return out + [self._ev(kind, response=body)], body

    def failed(self, code: str, message: str, param: str | None) -> list[dict[str, Any]]:
        error = {"code": code, "message": message}
        return [self._ev("error", code=code, message=message, param=param),
                self._ev("response.failed", response=self._response(None, "failed", error))]


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
