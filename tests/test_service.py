"""Running unattended: the unit and plist `provider service install` renders, systemd's notify protocol over a
real socket (EXTEND_TIMEOUT while loading, READY, STATUS, WATCHDOG that stops when the engine hangs), the
`local = true` key, `provider status`, the single-instance lock, and start-up checks before any load."""

import json
import os
import plistlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import LocalServer, until_blocking

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path, **extra) -> dict:
    return os.environ | {"XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_STATE_HOME": str(tmp_path / "state"),
                         "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"} | extra


def _provider(*args, env, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "provider", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _render(tmp_path, *kind) -> str:
    r = _provider("service", "install", "--dry-run", *kind, env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    return r.stdout


def _systemd_analyze() -> str | None:
    found = shutil.which("systemd-analyze")
    if found is None and os.environ.get("CI"):  # .ci/run installs it: missing there is a failure, not a skip
        pytest.fail("systemd-analyze is missing in CI")
    return found


@pytest.mark.parametrize("kind", [(), ("--system",)])
def test_the_rendered_unit_passes_systemd_analyze_verify(tmp_path, kind):
    text = _render(tmp_path, *kind)
    assert not (tmp_path / "config").exists()  # a dry run writes nothing
    unit = tmp_path / "provider.service"
    unit.write_text(text)
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart="))
    assert Path(argv[0]).is_file() and argv[1:3] == ["start", "--config"] and "--log-format" in argv
    assert "Type=notify" in text and "WatchdogSec=" in text and "RestartPreventExitStatus=2" in text
    if kind:
        assert "DynamicUser=yes" in text and "ProtectSystem=strict" in text and "/etc/provider/config.toml" in text
    else:
        assert str(tmp_path / "config" / "provider" / "config.toml") in text
        assert f"XDG_STATE_HOME={tmp_path / 'state'}" in text  # the installer's own directories
    analyze = _systemd_analyze()
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert r.returncode == 0 and "provider.service" not in r.stderr, r.stderr


def test_only_allowlisted_variables_reach_the_service(tmp_path):
    env = _env(tmp_path, HF_HOME=str(tmp_path / "hf"), HF_TOKEN="hf_secret", AWS_SECRET_ACCESS_KEY="x")
    text = _provider("service", "install", "--dry-run", env=env).stdout
    assert f"HF_HOME={tmp_path / 'hf'}" in text
    assert "hf_secret" not in text and "AWS_SECRET" not in text


def test_the_rendered_plist_parses_with_the_expected_keys(tmp_path):
    plist = plistlib.loads(_render(tmp_path, "--launchd").encode())
    assert plist["Label"] == "com.provider.node" and plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["ThrottleInterval"] > 0
    assert plist["ExitTimeOut"] >= 30
    args = plist["ProgramArguments"]
    assert Path(args[0]).is_file() and args[1:3] == ["start", "--config"] and args[-2:] == ["--log-format", "json"]
    state = tmp_path / "state" / "provider"
    assert plist["StandardErrorPath"] == str(state / "provider.err.log")  # logs in the state directory
    assert plist["StandardOutPath"] == str(state / "provider.out.log")
    assert plist["EnvironmentVariables"]["XDG_STATE_HOME"] == str(tmp_path / "state")


def test_install_writes_the_unit_and_a_starter_config_and_uninstall_removes_it(tmp_path):
    env = _env(tmp_path, HOME=str(tmp_path / "home"))
    r = _provider("service", "install", env=env)
    unit = tmp_path / "home" / ".config/systemd/user/provider.service"
    assert r.returncode == 0 and unit.is_file() and "systemctl --user enable --now provider" in r.stdout
    assert "local = true" in (tmp_path / "config" / "provider" / "config.toml").read_text()
    status = _provider("service", "status", env=env)
    assert status.returncode == 0 and "installed at" in status.stdout and "daemon: not running" in status.stdout
    state = json.loads(_provider("service", "status", "--json", env=env).stdout)
    assert state == {"kind": "systemd-user", "unit": str(unit), "installed": True, "daemon_running": False,
                     "daemon_pid": None,
                     "state_dir": state["state_dir"]} and state["state_dir"].startswith(str(tmp_path)), state
    assert _provider("service", "uninstall", env=env).returncode == 0 and not unit.exists()
    assert _provider("service", "status", env=env).returncode == 1
    assert json.loads(_provider("service", "status", "--json", env=env).stdout)["installed"] is False


def _notify_socket(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(1.0)
    return sock


def _messages(sock, enough) -> list[list[str]]:
    """The daemon's notify messages (each a datagram's lines) until `enough(messages)` holds."""
    out: list[list[str]] = []

    def more() -> bool:
        try:
            out.append(sock.recv(4096).decode().splitlines())
        except socket.timeout:
            pass
        return enough(out)

    until_blocking(more, lambda: f"not enough; the last ones: {out[-6:]}")
    return out


def _lines(messages: list[list[str]]) -> list[str]:
    return [line for m in messages for line in m]


def test_the_rendered_unit_serves_under_systemd_notify_and_its_watchdog_stops_when_the_engine_hangs(
        fixtures_dir, tmp_path):
    model = tmp_path / "faulty-qwen"
    shutil.copytree(fixtures_dir / "qwen3-tiny", model)
    env = _env(tmp_path)
    config = tmp_path / "config" / "provider" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'local = true\nport = 0\nauth = false\nmodel = "{model}"\n')  # no coordinator
    text = _render(tmp_path)
    argv = shlex.split(next(x for x in text.splitlines() if x.startswith("ExecStart=")).removeprefix("ExecStart="))
    sock = _notify_socket(tmp_path)
    # The unit's own command line; only the executable is swapped for the fault-injecting launcher.
    proc = subprocess.Popen([sys.executable, "-m", "tests.faulty_node", *argv[1:]], cwd=ROOT, env=env | {
        "NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000", "FAULT": "hang"},
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, "the daemon exited"
            if "/v1" in line:
                url = line.split()[-1].removesuffix("/v1")
        seen = _lines(_messages(sock, lambda ms: _lines(ms).count("WATCHDOG=1") >= 3))
        extend = [i for i, m in enumerate(seen) if m.startswith("EXTEND_TIMEOUT_USEC=")]
        ready = seen.index("READY=1")
        assert extend and extend[0] < ready, seen  # extended while the model loaded, then ready
        assert any(m.startswith("STATUS=ok, local; models faulty-qwen") for m in seen[ready:]), seen
        import httpx

        with pytest.raises(httpx.TimeoutException):  # this prompt wedges the engine's forward
            httpx.post(url + "/v1/completions", json={"prompt": "a prompt that hangs", "max_tokens": 2}, timeout=2)
        # The hang is noticed: a status without a ping (after the last pings from before it) ...
        _messages(sock, lambda ms: ms and "WATCHDOG=1" not in ms[-1] and any(m.startswith("STATUS=") for m in ms[-1]))
        # ... and the pings do not come back while the engine stays wedged (six intervals of 0.5 s).
        after = _lines(_messages(sock, lambda ms: len(ms) >= 6))
        assert "WATCHDOG=1" not in after, after
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        sock.close()


def test_status_reads_the_live_daemon_and_a_second_instance_is_refused(fixtures_dir, tmp_path):
    env = _env(tmp_path)
    assert _provider("status", env=env).returncode == 3  # nothing runs yet
    srv = LocalServer(fixtures_dir / "qwen3-tiny", tmp_path, "--no-auth")
    try:
        until_blocking(lambda: _provider("status", env=env).returncode == 0, "no status of the live daemon")
        body = json.loads(_provider("status", "--json", env=env).stdout)
        assert body["pid"] == srv.proc.pid and body["mode"] == "local" and body["local_url"] == srv.url
        assert body["health"] == "ok" and body["uptime_s"] >= 0 and "jobs_kv_bytes" in body["memory"]
        assert [m["id"] for m in body["models"] if m["state"] == "ready"] == ["qwen3-tiny"]
        assert body["coordinator_session"] is None and body["counters"]["jobs_completed"] == 0
        assert body["source"] == "live"  # asked over the control socket, not read from the snapshot file
        text = _provider("status", env=env).stdout
        assert f"pid {srv.proc.pid}" in text and "qwen3-tiny (ready" in text and "status: live" in text
        srv.proc.send_signal(signal.SIGSTOP)  # a daemon that does not answer: its last snapshot, and its age
        try:
            stale = _provider("status", env=env)
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        assert stale.returncode == 0 and "status: snapshot written" in stale.stdout, stale.stdout
        assert "s ago (the daemon did not answer)" in stale.stdout
        second = _provider("start", "--local", "--port", "0", "--model", str(fixtures_dir / "qwen3-tiny"), env=env)
        assert second.returncode == 75 and f"pid {srv.proc.pid}" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
    finally:
        assert srv.stop() == 0
    r = _provider("status", env=env)
    assert r.returncode == 3 and "no provider daemon is running" in r.stderr


def _broken_start(tmp_path, *args, env=None) -> subprocess.CompletedProcess:
    return _provider("start", "--local", "--log-format", "json", *args, env=env or _env(tmp_path), timeout=60)


def test_broken_start_ups_are_one_line_errors_before_any_model_loads(fixtures_dir, tmp_path):
    model = ["--model", str(fixtures_dir / "qwen3-tiny")]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = {
            "port in use": (_broken_start(tmp_path, "--port", port, *model), 69, "already in use"),
            "missing config": (_broken_start(tmp_path, "--config", str(tmp_path / "nope.toml"), *model), 2,
                               "does not exist"),
        }
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases["unwritable state dir"] = (_broken_start(tmp_path, "--port", "0", *model, env=_env(
        tmp_path, XDG_STATE_HOME=str(blocker))), 73, "state directory")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_concurrent_jobs = 0\n")
    cases["bad key"] = (_broken_start(tmp_path, "--config", str(bad), *model), 2, "max_concurrent_jobs")
    for name, (r, code, fragment) in cases.items():
        assert r.returncode == code, (name, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], (name, r.stderr)
        assert "model_loaded" not in r.stdout + r.stderr, name
