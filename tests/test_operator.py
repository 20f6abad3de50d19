"""What an operator runs into: --config anywhere, the bundled pair in the models CLI, access lines, CORS."""

import json
import os
import subprocess
import sys

import httpx
import pytest
import structlog

from provider import logs
from tests.helpers import LocalServer, run
from tools.harness.nodes import harness, job


def _cli(tmp_path, *args):
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
                        "XDG_STATE_HOME": str(tmp_path / "state"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "provider", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("args", [
    ["--config", "{cfg}", "models", "list"], ["models", "--config", "{cfg}", "list"],
    ["models", "list", "--config", "{cfg}"], ["doctor", "--config", "{cfg}"]])
def test_config_is_accepted_anywhere(tmp_path, args):
    cfg = tmp_path / "my.toml"
    cfg.write_text("memory_budget_gb = 0.0001\n")  # nothing fits: proof the file was read
    out = _cli(tmp_path, *[a.format(cfg=cfg) for a in args])
    assert "too large for the budget" in out.stdout or "no model fits" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("args", [["start", "--local"], ["models", "list"], ["doctor"]])
def test_a_missing_config_file_is_a_one_line_error(tmp_path, args):
    out = _cli(tmp_path, *args, "--config", str(tmp_path / "nope.toml"))
    assert out.returncode in (1, 2) and "nope.toml does not exist" in out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "serving" not in out.stdout


def test_models_list_and_verify_see_what_start_serves(tmp_path):
    listing = _cli(tmp_path, "models", "list")
    assert listing.returncode == 0 and "gemma4-demo" in listing.stdout and "[mtp]" in listing.stdout
    verify = _cli(tmp_path, "models", "verify", "gemma4-demo")
    assert verify.returncode == 0 and "model sha256 " in verify.stdout, verify.stderr


def test_every_http_request_gets_one_access_line_and_cors_is_refused(fixtures_dir, tmp_path):
    marker = "okapi-canary-31"
    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path)
    try:
        h = srv.headers
        ok = httpx.post(srv.url + "/v1/completions", headers=h, timeout=60,
                        json={"prompt": marker, "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200
        assert httpx.post(srv.url + "/v1/completions", headers=h, json={"prompt": 5}).status_code == 400
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/nothing", headers=h).status_code == 404
        pre = httpx.options(srv.url + "/v1/chat/completions",
                            headers={"Origin": "https://example.test", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 403 and pre.json()["error"]["code"] == "cors_disabled"
    finally:
        assert srv.stop() == 0
    lines = [json.loads(line) for line in srv.logs().splitlines() if '"http_request"' in line]
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("POST", "/v1/completions", 200), ("POST", "/v1/completions", 400), ("GET", "/v1/models", 401),
        ("GET", "/v1/nothing", 404), ("OPTIONS", "/v1/chat/completions", 403)]
    served = lines[0]
    assert served["job_id"] == ok.json()["id"] and served["completion_tokens"] == ok.json()["usage"][
        "completion_tokens"] and served["duration_ms"] > 0
    assert marker not in srv.logs()


def test_every_coordinator_job_gets_one_access_line(fixtures_dir, tmp_path):
    logs.configure("info", "json")  # the suite runs at warning; access lines are info

    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            with structlog.testing.capture_logs() as captured:
                coord.dispatch(s, job("ok", "g", max_tokens=4))
                coord.dispatch(s, job("bad", "g", temperature=9.0))
                await coord.outcome("ok")
                await coord.outcome("bad")
        lines = {x["job_id"]: x for x in captured if x["event"] == "coordinator_job"}
        assert lines["ok"]["outcome"] == "job_done" and lines["ok"]["completion_tokens"] >= 1
        assert lines["ok"]["duration_ms"] > 0
        assert lines["bad"]["outcome"] == "job_error" and lines["bad"]["cause"] == "ERROR_CAUSE_INVALID_REQUEST"

    run(main())


def test_metrics_parse_as_prometheus_text_and_count_the_jobs_run(fixtures_dir):
    from prometheus_client.parser import text_string_to_metric_families

    from provider.local.server import start_local_api
    from tests.helpers import make_node

    async def main(public: bool):
        node = make_node({"q": fixtures_dir / "qwen3-tiny"}, metrics_public=public)
        runner, url = await start_local_api(node, "127.0.0.1", 0, "sekrit")
        auth = {"Authorization": "Bearer sekrit"}
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                usages = []
                for prompt in ("The cache", "A batch of tokens"):
                    r = await client.post("/v1/completions", headers=auth,
                                          json={"model": "q", "prompt": prompt, "max_tokens": 5, "temperature": 0})
                    usages.append(r.json()["usage"])
                anonymous = await client.get("/metrics")
                text = (await client.get("/metrics", headers=auth)).text
        finally:
            await runner.cleanup()
            await node.stop()
        return anonymous.status_code, text, usages

    status, text, usages = run(main(public=False))
    assert status == 401
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name, suffix=""):
        return next(s.value for s in families[name].samples if s.name == name + suffix)

    assert value("provider:generation_tokens", "_total") == sum(u["completion_tokens"] for u in usages)
    assert value("provider:prompt_tokens", "_total") == sum(u["prompt_tokens"] for u in usages)
    assert value("provider:request_success", "_total") == 2
    assert value("provider:time_to_first_token_seconds", "_count") == 2
    assert value("provider:e2e_request_latency_seconds", "_count") == 2
    assert value("provider:inter_token_latency_seconds", "_count") == sum(
        u["completion_tokens"] - 1 for u in usages)
    assert value("provider:num_requests_running") == 0 and value("provider:num_requests_waiting") == 0
    assert value("provider:spec_decode_num_draft_tokens", "_total") == 0
    assert value("provider:memory_budget_bytes") > value("provider:memory_free_bytes") > 0
    assert [s.labels for s in families["provider:model_load_seconds"].samples] == [{"model_name": "q"}]
    assert run(main(public=True))[0] == 200  # metrics_public: no token needed


def test_cors_answers_configured_origins_only(fixtures_dir):
    from provider.local.server import start_local_api
    from tests.helpers import make_node

    async def main():
        node = make_node({"q": fixtures_dir / "qwen3-tiny"}, cors_origins="http://localhost:3000")
        runner, url = await start_local_api(node, "127.0.0.1", 0, "sekrit")
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                ask = {"Access-Control-Request-Method": "POST"}
                ok = await client.options("/v1/completions", headers=ask | {"Origin": "http://localhost:3000"})
                other = await client.options("/v1/completions", headers=ask | {"Origin": "https://evil.test"})
                real = await client.post("/v1/completions", headers={
                    "Origin": "http://localhost:3000", "Authorization": "Bearer sekrit"}, json={
                    "model": "q", "prompt": "x", "max_tokens": 2, "stream": True})
        finally:
            await runner.cleanup()
            await node.stop()
        return ok, other, real

    ok, other, real = run(main())
    assert ok.status_code == 204 and ok.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "Authorization" in ok.headers["Access-Control-Allow-Headers"]
    assert other.status_code == 403 and other.json()["error"]["code"] == "cors_disabled"
    assert real.status_code == 200 and real.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
