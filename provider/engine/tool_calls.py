"""A job's output text split, as it streams, into content and tool calls.

Text outside a call is content; text from the format's start marker to its end marker is one call, parsed
with the model's own parser (mlx-lm's, or the generic JSON one) when its end arrives. Text that may be the
beginning of a start marker is held back until it is known not to be. Whitespace between calls (and around
them) is not content. A call cut short (max_tokens) or that does not parse goes out as the text it was.
"""

from __future__ import annotations

import json
import secrets

from .. import logs
from ..outputs import ToolCall
from ..models.tool_format import ToolFormat

log = logs.get("engine")


class ToolCallSplitter:
    def __init__(self, fmt: ToolFormat, tools: list[dict]):
        self._fmt = fmt
        self._tools = tools  # as the parser may want them (OpenAI's shape)
        self._text = ""  # held back: possibly the start of a marker, or whitespace
        self._call: str | None = None  # inside a call: its text so far
        self._gap = ""  # the whitespace before the current call
        self.calls = 0

    def feed(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """More output text; the content and the calls it completes."""
        content, calls = [], []
        self._text += text
        while True:
            if self._call is not None:
                end = self._text.find(self._fmt.end) if self._fmt.end else -1
                if end < 0:  # all but what may begin the end marker joins the call
                    keep = _partial_suffix(self._text, self._fmt.end) if self._fmt.end else 0
                    self._call += self._text[:len(self._text) - keep]
                    self._text = self._text[len(self._text) - keep:]
                    break
                self._call += self._text[:end]
                self._text = self._text[end + len(self._fmt.end):]
                done = self._parse(self._call)
                if done is None:
                    content.append(self._gap + self._fmt.start + self._call + self._fmt.end)
                calls += done or []
                self._call = None
                continue
            start = self._text.find(self._fmt.start)
            if start >= 0:
                before = self._text[:start].rstrip()
                if before:
                    content.append(before)
                self._gap = self._text[len(before):start]  # given back if the call turns out to be text
                self._call, self._text = "", self._text[start + len(self._fmt.start):]
                continue
            keep = _partial_suffix(self._text, self._fmt.start)
            ready = self._text[:len(self._text) - keep].rstrip()  # trailing whitespace waits: it is content
            if ready:  # only if more content follows
                content.append(ready)
                self._text = self._text[len(ready):]
            break
        return "".join(content), tuple(calls)

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """The end of the output: a call without its end marker is parsed if its format allows, else it is text."""
        content, calls = "", ()
        if self._call is not None:
            text = self._call + self._text
            done = self._parse(text) if not self._fmt.end else None
            if done is None:
                content = self._gap + self._fmt.start + text
            calls = tuple(done or ())
        elif self._text.strip() or not self.calls:
            content = self._text
        self._text, self._call = "", None
        return content, calls

    def _parse(self, text: str) -> list[ToolCall] | None:
        try:
            parsed = self._fmt.parse(text, self._tools)
        except Exception as e:  # the model's text, not the node, is at fault: it stays content
            log.info("tool_call_unparsed", error=f"{type(e).__name__}: {e}"[:200])
            return None
        out = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            args = call.get("arguments", {})
            out.append(ToolCall("call_" + secrets.token_hex(12), call["name"],
                                args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        self.calls += len(out)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
