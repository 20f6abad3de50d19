"""Service integration: systemd's notify protocol over a real socket, and the shipped unit files."""

import configparser
import plistlib
import socket
import time
from pathlib import Path

from tests.helpers import LocalServer

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_ready_and_watchdog_reach_systemd(fixtures_dir, tmp_path):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(30)
    srv = LocalServer(fixtures_dir / "qwen3-tiny", tmp_path, "--no-auth",
                      env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"})
    try:
        messages = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not {"READY=1", "WATCHDOG=1"} <= set(messages):
            messages.append(sock.recv(256).decode())
        assert messages[0] == "READY=1"  # only after the model is loaded and the API listens
        assert "WATCHDOG=1" in messages
        assert srv.stop() == 0
        messages.append(sock.recv(256).decode())
        while "STOPPING=1" not in messages:
            messages.append(sock.recv(256).decode())
    finally:
        sock.close()


def test_systemd_unit_has_the_expected_hardening():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "provider.service")
    svc = unit["Service"]
    assert svc["Type"] == "notify" and svc["Restart"] == "on-failure" and int(svc["WatchdogSec"]) > 0
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    assert svc["StateDirectory"] == "provider" and svc["CacheDirectory"] == "provider"


def test_launchd_plist_restarts_only_on_failure():
    plist = plistlib.loads((DEPLOY / "com.provider.node.plist").read_bytes())
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["ThrottleInterval"] > 0
    assert plist["ProgramArguments"][1] == "start" and plist["ExitTimeOut"] >= 30
