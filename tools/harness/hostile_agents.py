"""Hostile bodies for the agent-facing APIs (Anthropic's /v1/messages and /v1/messages/count_tokens, OpenAI's
/v1/responses and /v1/responses/{id}), shared by tests/test_hostile_agents.py and the fuzz campaign.

Each case must end in a 4xx in its API's own error shape (Anthropic's {"type": "error", "error": {type,
message}}; OpenAI's {"error": {message, type, param, code}}) or, for what agents may send and the node leaves
out, a 200; never a 5xx, and the node serves a good request after it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .hostile import HOSTILE_SCHEMAS, HUGE, TEXT_EDGES

BIG = int("9" * 400)
MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"


class AgentCase(NamedTuple):
    name: str
    path: str
    body: Any  # JSON-able (None: no body, for GET and DELETE)
    method: str = "POST"


def error_shape_ok(path: str, status: int, body: Any) -> bool:
    """Whether a response's status and body are what the path's API promises: under 500, and a 4xx in its shape."""
    if status >= 500:
        return False
    if status < 400:
        return True
    if path.startswith(MESSAGES):
        e = body.get("error") if isinstance(body, dict) else None
        return body.get("type") == "error" and isinstance(e, dict) and isinstance(e.get("type"), str) \
            and isinstance(e.get("message"), str)
    e = body.get("error") if isinstance(body, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str)


def _anthropic(model: str) -> list[tuple[str, Any]]:
    user = [{"role": "user", "content": "Hi"}]
    good = {"model": model, "max_tokens": 2, "messages": user, "temperature": 0}

    def tool(schema: Any, name: Any = "f", description: Any = "d") -> dict:
        return good | {"tools": [{"name": name, "description": description, "input_schema": schema}]}

    def content(*blocks: Any) -> dict:
        return good | {"messages": [{"role": "user", "content": list(blocks)}]}

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    return [
        *[(f"body {v!r:.20}", v) for v in ([], "x", None, 5, [good])],
        *[(f"max_tokens {v!r:.24}", good | {"max_tokens": v}) for v in (0, -1, BIG, *HUGE[:3], 1.5, "2", True, None)],
        *[(f"{k} {v!r:.24}", good | {k: v}) for k in ("temperature", "top_p", "top_k")
          for v in (BIG, -BIG, 1e308, -1, "0", [0], {"a": 1})],
        *[(f"messages {v!r:.24}", good | {"messages": v}) for v in ([], "hi", [None], [[]], [{"role": "user"}],
                                                                   [{"role": 5, "content": "x"}],
                                                                   [{"role": "tool", "content": "x"}],
                                                                   [{"role": "user", "content": 5}],
                                                                   [{"role": "user", "content": {"a": 1}}])],
        *[(f"text {t!r:.16}", good | {"messages": [{"role": "user", "content": t}]}) for t in TEXT_EDGES],
        ("many messages", good | {"messages": [{"role": "user", "content": "a"}] * 20_000}),
        ("block not an object", content("x")),
        ("block type missing", content({"text": "x"})),
        ("text block number", content({"type": "text", "text": 5})),
        ("unknown block", content({"type": "document", "source": {"type": "url", "url": "http://x"}})),
        ("image url", content({"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/"}})),
        ("image bad base64", content({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                    "data": "@@@"}})),
        ("image svg", content({"type": "image", "source": {"type": "base64", "media_type": "image/svg+xml",
                                                             "data": "PHN2Zy8+"}})),
        ("image media with params", content({"type": "image", "source": {
            "type": "base64", "media_type": "image/png;charset=x,", "data": "iVBORw0KGgo="}})),
        ("image not decodable", content(image)),
        ("image source number", content({"type": "image", "source": 5})),
        ("tool_use in user turn", content({"type": "tool_use", "id": "t", "name": "f", "input": {}})),
        ("tool_use input list", good | {"messages": user + [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]}),
        ("tool_use bad name", good | {"messages": user + [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "bad name!", "input": {}}]}] + user}),
        ("tool_use huge input", good | {"messages": user + [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {"a": "x" * 70_000}}]}] + user}),
        ("tool_result number", content({"type": "tool_result", "tool_use_id": "t", "content": 5})),
        ("tool_result id missing", content({"type": "tool_result", "content": "x"})),
        ("tool_result blocks odd", content({"type": "tool_result", "tool_use_id": "t", "content": [5, image]})),
        ("thinking block odd", content({"type": "thinking", "thinking": None})),
        *[(f"system {v!r:.24}", good | {"system": v}) for v in (5, [5], [{"type": "text", "text": 5}], {"a": 1})],
        ("stop_sequences odd", good | {"stop_sequences": [5]}),
        ("stop_sequences many", good | {"stop_sequences": ["x"] * 10_000}),
        ("stop_sequences long", good | {"stop_sequences": ["x" * 100_000]}),
        ("stream string", good | {"stream": "yes"}),
        *[(f"tools {v!r:.24}", good | {"tools": v}) for v in (5, "x", [5], [{}], {"name": "f"})],
        *[(f"schema {i}", tool(s)) for i, s in enumerate(HOSTILE_SCHEMAS)],
        ("tool name odd", tool({"type": "object"}, name="bad name!")),
        ("tool name number", tool({"type": "object"}, name=5)),
        ("tool description number", tool({"type": "object"}, description=5)),
        ("tool description huge", tool({"type": "object"}, description="d" * 200_000)),
        ("tools many", good | {"tools": [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(3000)]}),
        ("tools hosted only, any", good | {"tools": [{"type": "web_search_20250305", "name": "web_search"}],
                                           "tool_choice": {"type": "any"}}),
        *[(f"tool_choice {v!r:.24}", tool({"type": "object"}) | {"tool_choice": v})
          for v in ("auto", 5, {"type": "sometimes"}, {"type": "tool"}, {"type": "tool", "name": 5},
                    {"type": "tool", "name": "g"}, {"type": "auto", "disable_parallel_tool_use": "yes"})],
        ("model number", good | {"model": 5}),
        ("model unknown", good | {"model": "claude-opus-4-1"}),
        ("agent extras odd", good | {"thinking": 5, "context_management": [None], "output_config": "x",
                                     "metadata": [1, 2], "cache_control": 5, "x" * 300: 1}),
    ]


def _responses(model: str) -> list[tuple[str, Any]]:
    good = {"model": model, "input": "Hi", "max_output_tokens": 2, "temperature": 0}

    def items(*xs: Any) -> dict:
        return good | {"input": list(xs)}

    def fn(schema: Any, name: Any = "f") -> dict:
        return {"type": "function", "name": name, "description": "d", "parameters": schema}

    msg = {"type": "message", "role": "user", "content": "Hi"}
    return [
        *[(f"body {v!r:.20}", v) for v in ([], "x", None, 5)],
        *[(f"input {v!r:.24}", good | {"input": v}) for v in (5, None, [], [5], [[]], {"a": 1}, "", [{}])],
        *[(f"max_output_tokens {v!r:.24}", good | {"max_output_tokens": v}) for v in (0, -1, BIG, 1.5, "2", True)],
        *[(f"{k} {v!r:.24}", good | {k: v}) for k in ("temperature", "top_p") for v in (BIG, -1, 3, "0", [0])],
        *[(f"text {t!r:.16}", good | {"input": t}) for t in TEXT_EDGES if t],
        ("many items", items(*[msg] * 20_000)),
        ("role odd", items({"type": "message", "role": "wizard", "content": "x"})),
        ("role number", items({"role": 5, "content": "x"})),
        ("content number", items({"type": "message", "role": "user", "content": 5})),
        ("part odd", items({"type": "message", "role": "user", "content": [{"type": "input_audio"}]})),
        ("part not an object", items({"type": "message", "role": "user", "content": [5]})),
        ("input_text number", items({"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                   "text": 5}]})),
        ("input_image url", items({"role": "user", "content": [{"type": "input_image",
                                                               "image_url": "http://169.254.169.254/"}]})),
        ("input_image bad", items({"role": "user", "content": [{"type": "input_image",
                                                               "image_url": "data:image/png;base64,@@"}]})),
        ("input_image detail odd", items({"role": "user", "content": [{"type": "input_image", "detail": 5,
                                                                      "image_url": "data:image/png;base64,AAAA"}]})),
        ("input_file", items({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]})),
        ("function_call args odd", items(msg, {"type": "function_call", "call_id": "c", "name": "f",
                                               "arguments": {"a": 1}})),
        ("function_call args not json", items(msg, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{bad"}, msg)),
        ("function_call args huge", items(msg, {"type": "function_call", "call_id": "c", "name": "f",
                                                "arguments": "x" * 70_000})),
        ("function_call name odd", items(msg, {"type": "function_call", "call_id": "c", "name": "bad name!",
                                               "arguments": "{}"}, msg)),
        ("output no call_id", items(msg, {"type": "function_call_output", "output": "x"})),
        ("output number", items(msg, {"type": "function_call_output", "call_id": "c", "output": 5})),
        ("output parts odd", items(msg, {"type": "function_call_output", "call_id": "c", "output": [5, {}]})),
        ("only instructions", good | {"input": [], "instructions": "x"}),
        ("instructions number", good | {"instructions": 5}),
        ("unknown items", items(msg, {"type": "reasoning", "encrypted_content": "x" * 1000}, {"type": 5}, {"id": 1})),
        *[(f"tools {v!r:.24}", good | {"tools": v}) for v in (5, "x", [5], [{}], {"type": "function"})],
        *[(f"schema {i}", good | {"tools": [fn(s)]}) for i, s in enumerate(HOSTILE_SCHEMAS)],
        *[(f"format schema {i}", good | {"text": {"format": {"type": "json_schema", "name": "r", "schema": s}}})
          for i, s in enumerate(HOSTILE_SCHEMAS)],
        ("tool name odd", good | {"tools": [fn({"type": "object"}, "bad name!")]}),
        ("tools many", good | {"tools": [fn({"type": "object"}, f"t{i}") for i in range(3000)]}),
        ("namespace nested", good | {"tools": [{"type": "namespace", "name": "n", "tools": [
            {"type": "namespace", "name": "m", "tools": [fn({"type": "object"})]}]}]}),
        ("namespace tools odd", good | {"tools": [{"type": "namespace", "name": "n", "tools": 5}]}),
        ("hosted tools", good | {"tools": [{"type": "web_search"}, {"type": "file_search"}, {"type": "custom",
                                                                                             "name": "apply_patch"}]}),
        *[(f"tool_choice {v!r:.24}", good | {"tools": [fn({"type": "object"})], "tool_choice": v})
          for v in (5, "sometimes", {"type": "function"}, {"type": "function", "name": 5},
                    {"type": "function", "name": "g"}, {"type": "web_search"})],
        ("parallel_tool_calls odd", good | {"tools": [fn({"type": "object"})], "parallel_tool_calls": "yes"}),
        *[(f"text.format {v!r:.24}", good | {"text": v}) for v in (5, {"format": 5}, {"format": {"type": "yaml"}},
                                                                 {"format": {"type": "json_schema"}},
                                                                 {"format": {"type": "json_schema", "name": "a b",
                                                                             "schema": {}}})],
        *[(f"{k} {v!r:.24}", good | {k: v}) for k in ("stream", "store") for v in ("yes", 1)],
        *[(f"previous_response_id {v!r:.24}", good | {"previous_response_id": v})
          for v in (5, "resp_missing", "x" * 100_000, ["resp_1"])],
        ("codex extras odd", good | {"reasoning": 5, "include": "x", "prompt_cache_key": [1], "client_metadata": 5,
                                     "x" * 300: 1}),
    ]


def agent_cases(model: str) -> list[AgentCase]:
    """Every case, for a node serving `model` (a fixture with a short context is fine)."""
    out = [AgentCase(f"messages: {n}", MESSAGES, b) for n, b in _anthropic(model)]
    out += [AgentCase(f"count_tokens: {n}", COUNT, {k: v for k, v in b.items() if k != "max_tokens"}
                      if isinstance(b, dict) else b) for n, b in _anthropic(model)[::3]]
    out += [AgentCase(f"responses: {n}", RESPONSES, b) for n, b in _responses(model)]
    for rid in ("resp_missing", "x" * 5000, "%00", "..%2F..%2Fetc"):
        out += [AgentCase(f"get {rid[:12]}", f"{RESPONSES}/{rid}", None, "GET"),
                AgentCase(f"delete {rid[:12]}", f"{RESPONSES}/{rid}", None, "DELETE")]
    return out


def good_request(model: str) -> tuple[str, dict]:
    """A request each API must still serve after the hostile ones."""
    return MESSAGES, {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


def agent_failures(url: str, headers: dict, model: str, timeout: float) -> tuple[int, list[tuple[str, str]]]:
    """Send every case to a live node at `url`; (cases sent, those that broke the promise: a 5xx, a 4xx not in
    its API's shape, a hang or a dropped connection, each as (name, detail)). For the fuzz campaign."""
    import json

    import httpx

    cases, bad = agent_cases(model), []
    with httpx.Client(timeout=timeout) as client:
        for case in cases:
            try:
                r = client.request(case.method, url + case.path, headers={"Content-Type": "application/json", **headers},
                                   content=None if case.body is None else json.dumps(case.body).encode())
            except httpx.HTTPError as e:
                bad.append((case.name, f"{type(e).__name__}: {e}"))
                continue
            try:
                body = r.json()
            except ValueError:
                body = r.text
            if not error_shape_ok(case.path, r.status_code, body):
                bad.append((case.name, f"{r.status_code} {r.text[:200]}"))
    return len(cases), bad
