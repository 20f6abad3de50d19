"""A node group on loopback, started with the documented commands: rank 0 is `provider start --local --group
HOSTFILE --rank 0` (a LocalServer), every other rank `provider start --group HOSTFILE --rank R` in a process of
its own, each with a home (state, config, cache) of its own, all with one group secret."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from .daemon import LocalServer


def write_hostfile(path: Path, ranks: int) -> Path:
    """MLX's ring hostfile for `ranks` ranks on 127.0.0.1, each on a port free now."""
    ports = []
    sockets = []
    for _ in range(ranks):  # held open together so no two ranks get the same port
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


def write_secret(path: Path) -> Path:
    """A group secret as `provider group init` writes it (0600), for every rank of a test group to share."""
    from provider.group.secret import create_secret

    if not path.exists():
        create_secret(path)
    return path


def loopback_specs(root: Path, ranks: int = 2) -> list:
    """Every rank's GroupSpec of a group on loopback under `root` (a hostfile and a secret made there), for code
    that drives the group's sockets directly, without starting ranks."""
    from provider.group.spec import group_spec

    root.mkdir(parents=True, exist_ok=True)
    hostfile = write_hostfile(root / "hosts.json", ranks)
    secret = write_secret(root / "secret")
    return [group_spec(str(hostfile), r, "ring", {}, str(secret)) for r in range(ranks)]


class Follower:
    """`provider start --group HOSTFILE --rank R --model M` in a subprocess, its output kept in a file."""

    def __init__(self, model: Path, home: Path, hostfile: Path, rank: int, *extra: str, env: dict | None = None):
        home.mkdir(parents=True, exist_ok=True)
        self.log_path = home / "follower.log"
        self.env = os.environ | {"HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(home / "config"),
                                 "XDG_STATE_HOME": str(home / "state"), "XDG_CACHE_HOME": str(home / "cache")} \
            | (env or {})
        self._out = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "provider", "start", "--model", str(model), "--group",
                                      str(hostfile), "--rank", str(rank), "--log-format", "json", *extra],
                                     stdout=self._out, stderr=subprocess.STDOUT, env=self.env)

    def logs(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.close()


def start_group(model: Path, home: Path, ranks: int = 2, *extra: str, env: dict | None = None
                ) -> tuple[LocalServer, list[Follower]]:
    """Rank 0 serving the local API, and its followers; the followers first (rank 0 waits for them to join)."""
    home.mkdir(parents=True, exist_ok=True)
    hostfile = write_hostfile(home / "hostfile.json", ranks)
    env = {"PROVIDER_GROUP_SECRET_FILE": str(write_secret(home / "group-secret"))} | (env or {})
    followers = [Follower(model, home / f"rank{r}", hostfile, r, *extra, env=env) for r in range(1, ranks)]
    (home / "rank0").mkdir(parents=True, exist_ok=True)
    try:
        leader = LocalServer(model, home / "rank0", "--group", str(hostfile), "--rank", "0", *extra, env=env)
    except BaseException:
        for f in followers:
            f.stop(signal.SIGKILL)
        raise
    return leader, followers
