"""Issue 36, finding 9: wherever the node writes its own log file, the file is bounded. Under launchd the node
keeps provider.log itself, rotated by size; launchd's redirects go to files that get only start-up lines and
crash output (launchd never rotates what it redirects)."""

import json
import logging
import plistlib
from pathlib import Path

from provider import logs
from provider.commands import service_files
from tests.helpers import LocalServer


def test_the_node_s_log_file_rotates_by_size_and_keeps_a_bounded_number_of_files(tmp_path):
    path = tmp_path / "provider.log"
    logs.configure("info", "json", file=str(path), max_bytes=20_000, backups=2)
    log = logs.get("test")
    for i in range(2000):
        log.info("line", i=i, pad="x" * 50)
    logging.getLogger("grpc").warning("a library's line")  # the libraries' lines go to the same file
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["provider.log", "provider.log.1", "provider.log.2"], files
    assert all((tmp_path / f).stat().st_size <= 20_000 for f in files)
    last = [json.loads(line) for line in path.read_text().splitlines()]
    assert last[-2]["i"] == 1999 and last[-1]["event"] == "a library's line" and last[-1]["logger"] == "grpc"


def test_the_launchd_agent_has_the_node_keep_its_log_and_redirects_only_the_rest(tmp_path):
    home = tmp_path / "home"
    s = service_files.plan("launchd", {}, home, Path("/opt/provider/.venv/bin/provider"))
    plist = plistlib.loads(service_files.render(s).encode())
    state = s.state_dir
    assert plist["EnvironmentVariables"][logs.LOG_FILE_ENV] == str(state / "provider.log")
    assert plist["StandardErrorPath"] == str(state / "provider.err.log")  # crash output: tracebacks, refusals
    assert plist["StandardOutPath"] == str(state / "provider.out.log")  # start-up lines


def test_a_daemon_given_a_log_file_writes_its_structured_log_there(fixtures_dir, tmp_path):
    """The whole way, as the launchd agent starts it: the environment names the file, stderr gets none of it."""
    log_file = tmp_path / "provider.log"
    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path, env={logs.LOG_FILE_ENV: str(log_file),
                                                                  "PROVIDER_LOG_LEVEL": "info"})
    try:
        import httpx

        r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=60,
                       json={"model": "llama-tiny", "prompt": "The cache", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0
    events = [json.loads(line)["event"] for line in log_file.read_text().splitlines()]
    assert "http_request" in events and "local_api_listening" in events, events[:20]
    assert not [line for line in srv.logs().splitlines() if line.startswith("{")]  # no JSON lines on stderr
