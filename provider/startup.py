"""Checks `provider start` makes before any model loads, and the one-instance lock on the state directory.

Each failure is a `StartupError`: one line for the operator and the exit code (sysexits-style, so a service
manager can tell a bad configuration, which restarting cannot fix, from a busy port).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

EXIT_CONFIG = 2  # bad configuration or arguments: restarting will not help
EXIT_UNAVAILABLE = 69  # the port is taken
EXIT_CANT_CREATE = 73  # the state directory cannot be written
EXIT_LOCKED = 75  # another instance runs on this state directory

LOCK_NAME = "provider.lock"


class StartupError(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def check_port_free(bind: str, port: int) -> None:
    """Bind the port as aiohttp will (SO_REUSEADDR), then let it go: a taken port is found before any load."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind, port))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise StartupError(f"port {port} on {bind} {why}; stop what holds it, or pick another with --port "
                               "(0 picks a free one)", EXIT_UNAVAILABLE) from None


def check_state_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise StartupError(f"the state directory {path} is not writable ({e.strerror}); fix its permissions or "
                           "point XDG_STATE_HOME elsewhere", EXIT_CANT_CREATE) from None


class InstanceLock:
    """An exclusive lock on STATE/provider.lock, holding the owner's pid, for as long as the process lives."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            pid = holder_pid(self.path.parent)
            raise StartupError(f"another provider (pid {pid or 'unknown'}) is running with the state directory "
                               f"{self.path.parent}; stop it first, or give this one its own XDG_STATE_HOME",
                               EXIT_LOCKED) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


def holder_pid(state_dir: Path) -> int | None:
    """The pid of the running instance on `state_dir`, or None when none holds the lock."""
    path = state_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held: somebody runs
            text = os.read(fd, 32).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
