"""Hostile bodies for the agent APIs (tools/harness/hostile_agents.py) against a live node: each is a 4xx in its
API's own error shape or, for what agents may send and the node leaves out, a 200; never a 5xx; and the node
serves a good request after each group of them (llama-tiny: vocabulary 512, context 1024)."""

import json

import httpx
import pytest

from tests.helpers import LocalServer
from tools.harness.hostile_agents import agent_cases, error_shape_ok, good_request

MODEL = "llama-tiny"
CASES = agent_cases(MODEL)


@pytest.fixture(scope="module")
def server(fixtures_dir, tmp_path_factory):
    srv = LocalServer(fixtures_dir / MODEL, tmp_path_factory.mktemp("hostile-agents"))
    yield srv
    assert srv.stop() == 0


def _send(server, case):
    content = None if case.body is None else json.dumps(case.body).encode()
    return httpx.request(case.method, server.url + case.path, content=content, timeout=120,
                         headers={"Content-Type": "application/json", **server.headers})


@pytest.mark.parametrize("group", range(0, len(CASES), 25), ids=lambda g: f"cases {g}-{g + 24}")
def test_hostile_agent_bodies_are_4xx_in_their_apis_shape_and_the_node_keeps_serving(server, group):
    bad = []
    for case in CASES[group:group + 25]:
        r = _send(server, case)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        if not error_shape_ok(case.path, r.status_code, body):
            bad.append((case.name, r.status_code, str(body)[:300]))
    assert not bad, bad
    path, good = good_request(MODEL)
    r = httpx.post(server.url + path, json=good, headers=server.headers, timeout=120)
    # A whole answer (a random model may end at its first token: no count of tokens is asked of it).
    assert r.status_code == 200 and r.json()["type"] == "message" and r.json()["stop_reason"] in (
        "end_turn", "max_tokens"), r.text
    assert server.proc.poll() is None
