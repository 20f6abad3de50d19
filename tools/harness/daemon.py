"""`provider start --local` in a subprocess on an ephemeral port: what tests, benchmarks and the fuzz campaign
run against (a real daemon, hit by real clients)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


class LocalServer:
    """`provider start --local` in a subprocess on an ephemeral port, with its logs kept in a file."""

    def __init__(self, model: Path | None, home: Path, *extra: str, env: dict | None = None,
                 module: str = "provider"):
        self.home = home
        self.log_path = home / "server.log"
        self.env = os.environ | {
            "HF_HUB_OFFLINE": "1",
            "XDG_CONFIG_HOME": str(home / "config"),
            "XDG_STATE_HOME": str(home / "state"),
            "XDG_CACHE_HOME": str(home / "cache"),
        } | (env or {})
        args = [sys.executable, "-m", module, "start", "--local", "--port", "0", "--log-format", "json", *extra]
        if model is not None:
            args += ["--model", str(model)]
        self._stderr = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._stderr, env=self.env, text=True)
        self.url = self._wait_for_url()
        token_file = home / "state" / "provider" / "local-api-token"
        self.token = token_file.read_text().strip() if "--no-auth" not in extra else None

    def _wait_for_url(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited: {lines} {self.log_path.read_text()[-2000:]}")
            lines.append(line)
            m = re.search(r"(http://\S+)/v1", line)
            if m:
                return m.group(1)
        raise TimeoutError("server did not print its URL")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def logs(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._stderr.close()
