"""XDG base directories for the node's config, state and cache."""

from __future__ import annotations

import os
from pathlib import Path

APP = "provider"


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var)
    # The XDG spec says relative paths are invalid and must be ignored.
    base = Path(value) if value and os.path.isabs(value) else Path.home() / fallback
    return base / APP


def config_dir() -> Path:
    return _xdg("XDG_CONFIG_HOME", ".config")


def state_dir() -> Path:
    return _xdg("XDG_STATE_HOME", ".local/state")


def cache_dir() -> Path:
    return _xdg("XDG_CACHE_HOME", ".cache")


def config_file() -> Path:
    return config_dir() / "config.toml"


def control_socket(state: Path | None = None) -> Path:
    """The daemon's control socket (`provider generate`, `models load`, the status command's probe)."""
    return (state or state_dir()) / "control.sock"


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to a file only the owner can read (0600), creating parents 0700."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)


def is_private(path: Path) -> bool:
    """True when neither group nor others can read or write the file."""
    return path.stat().st_mode & 0o077 == 0
