"""deploy/grafana/provider-node.json, the fleet's board over /metrics: a well-formed Grafana dashboard (the keys
its schema requires, panels placed on the grid, every panel with its queries), and every metric its PromQL names
is one a live node's /metrics exports."""

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools.harness.daemon import LocalServer

BOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "provider-node.json"
REQUIRED = {"annotations", "editable", "panels", "schemaVersion", "templating", "time", "title", "uid", "version"}
PANEL = {"id", "type", "title", "gridPos"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}  # Grafana's own


def board() -> dict:
    return json.loads(BOARD.read_text())


def queries(b: dict) -> list[str]:
    return [t["expr"] for p in b["panels"] for t in p.get("targets", [])]


def selected_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every name before a label matcher or a range, and every
    `provider:` name wherever it stands."""
    names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", expr)) - {"by", "without", "on", "ignoring"}
    return names | set(re.findall(r"\bprovider:[a-zA-Z0-9_:]+", expr))


def test_the_board_is_a_well_formed_dashboard():
    b = board()
    assert not REQUIRED - b.keys(), REQUIRED - b.keys()
    assert isinstance(b["schemaVersion"], int) and b["schemaVersion"] >= 36
    assert b["uid"] and b["title"] and b["time"]["from"] and b["time"]["to"]
    ids = [p["id"] for p in b["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in b["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    cells = set()
    for p in b["panels"]:
        assert not PANEL - p.keys(), (p.get("title"), PANEL - p.keys())
        g = p["gridPos"]
        assert all(isinstance(g[k], int) and g[k] >= 0 for k in "hwxy") and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        targets = p.get("targets", [])
        assert targets, f"{p['title']} has no query"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), p["title"]
        for t in targets:
            expr = t["expr"]
            assert expr.strip() and t["datasource"]["uid"] == "${datasource}", p["title"]
            for opened, closed in ("()", "{}", "[]"):
                assert expr.count(opened) == expr.count(closed), (p["title"], expr)
            assert expr.count('"') % 2 == 0, expr
            assert set(re.findall(r"\$(\w+)", expr)) <= variables | GRAFANA_VARIABLES, expr
    assert {"stat", "timeseries", "table"} <= {p["type"] for p in b["panels"]}


def test_the_checker_sees_a_name_not_exported():
    assert selected_metrics('sum by (le) (rate(provider:nope_bucket{instance=~"$x"}[5m])) / up{job="a"}') == {
        "provider:nope_bucket", "up"}
    assert selected_metrics("1 + provider:a / provider:b") == {"provider:a", "provider:b"}


@pytest.fixture(scope="module")
def scraped(fixtures_dir, tmp_path_factory) -> set[str]:
    """The sample names a live fixture node's /metrics exports after one job (a histogram exports its series once
    a model has one), with its family names beside them."""
    model = fixtures_dir / "llama-tiny"
    # Its end tokens barred, so the job has gaps between tokens: a random fixture may otherwise end at once, and
    # the inter-token histogram would have no series.
    never_end = {str(i): -100 for i in json.loads((model / "config.json").read_text())["eos_token_id"]}
    server = LocalServer(model, tmp_path_factory.mktemp("grafana"))
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=120,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "logit_bias": never_end})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4, r.text
        text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
    finally:
        server.stop()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names |= {s.name for s in family.samples}
    return names


def test_every_metric_the_board_names_is_one_metrics_exports(scraped):
    used = set().union(*map(selected_metrics, queries(board())))
    assert used, "the board names no metric"
    missing = sorted(used - scraped)
    assert not missing, f"the board queries {missing}, which /metrics does not export; it has " \
                        f"{sorted(n for n in scraped if n.startswith('provider:'))}"
    # Counters are queried by their sample names (the _total, _bucket suffixes), never by the bare family.
    assert "provider:generation_tokens_total" in used and "provider:generation_tokens" not in used
    assert "provider:time_to_first_token_seconds_bucket" in used
