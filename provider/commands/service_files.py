"""`provider service install | uninstall | status`: the systemd unit or launchd agent, rendered from the
templates in deploy/ with this installation's real paths.

Rendering is pure (`plan` decides paths, `render` fills the template); only `install`/`uninstall` touch the
disk. The environment passed into the service is an explicit allowlist, never the installer's whole
environment (which may hold tokens and secrets).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

from .. import paths, startup

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# Passed through when set: where models are cached and how to reach the package index / Hub.
ENV_ALLOWLIST = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HTTPS_PROXY", "HTTP_PROXY",
                 "NO_PROXY", "PROVIDER_MODELS_DIR")
# A user service runs with the installer's own directories.
USER_DIRS = ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME")
STARTER_CONFIG = """\
# Written by `provider service install`. Keys: see the README's Configuration table.
local = true           # serve the local OpenAI-compatible API (127.0.0.1:8080, bearer token in the state dir)
# coordinator = "grpcs://coordinator.example.net:443"
"""


@dataclass(frozen=True)
class Service:
    kind: str  # systemd-user | systemd-system | launchd
    template: Path
    unit: Path  # where the rendered file goes
    provider: Path  # the installed `provider` executable
    config: Path
    state_dir: Path
    env: tuple[tuple[str, str], ...]

    @property
    def manager_commands(self) -> list[str]:
        if self.kind == "launchd":
            return [f"launchctl bootstrap gui/{os.getuid()} {self.unit}"]
        user = "" if self.kind == "systemd-system" else " --user"
        return [f"systemctl{user} daemon-reload", f"systemctl{user} enable --now provider"]


def default_kind() -> str:
    return "launchd" if sys.platform == "darwin" else "systemd-user"


def installed_provider() -> Path:
    """The `provider` beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "provider"
    if beside.exists():
        return beside
    found = shutil.which("provider")
    return Path(found) if found else beside


def plan(kind: str, env: dict[str, str], home: Path, provider: Path) -> Service:
    passed = [k for k in ENV_ALLOWLIST if env.get(k)]
    if kind == "systemd-system":
        return Service(kind, DEPLOY / "provider.service", Path("/etc/systemd/system/provider.service"), provider,
                       Path("/etc/provider/config.toml"), Path("/var/lib/provider"),
                       tuple((k, env[k]) for k in passed))
    passed += [k for k in USER_DIRS if env.get(k)]
    config, state = paths.config_file(), paths.state_dir()
    if kind == "launchd":
        return Service(kind, DEPLOY / "com.provider.node.plist",
                       home / "Library/LaunchAgents/com.provider.node.plist", provider, config, state,
                       tuple((k, env[k]) for k in passed))
    return Service(kind, DEPLOY / "provider-user.service", home / ".config/systemd/user/provider.service",
                   provider, config, state, tuple((k, env[k]) for k in passed))


def render(s: Service) -> str:
    if s.kind == "launchd":
        env = "".join(f"    <key>{escape(k)}</key>\n    <string>{escape(v)}</string>\n" for k, v in s.env)
        values = {"provider": escape(str(s.provider)), "config": escape(str(s.config)),
                  "state_dir": escape(str(s.state_dir)), "environment": env}
    else:
        env = "\n".join(f'Environment="{k}={_systemd_quote(v)}"' for k, v in s.env)
        values = {"provider": _systemd_path(s.provider), "config": _systemd_path(s.config),
                  "state_dir": str(s.state_dir), "environment": env + "\n" if env else "",
                  "readme": str(DEPLOY.parent / "README.md")}
    return Template(s.template.read_text()).substitute(values)


def _systemd_path(p: Path) -> str:
    text = str(p)
    if any(c.isspace() for c in text) or '"' in text:
        raise ValueError(f"{text}: systemd paths here must not contain spaces or quotes")
    return text


def _systemd_quote(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")


def install(s: Service, *, dry_run: bool) -> int:
    text = render(s)
    if dry_run:
        print(f"provider: would write {s.unit}" + ("" if s.config.exists() else f" and a starter {s.config}"),
              file=sys.stderr)
        print(text, end="")
        return 0
    s.unit.parent.mkdir(parents=True, exist_ok=True)
    s.unit.write_text(text)
    print(f"wrote {s.unit}")
    if not s.config.exists():
        s.config.parent.mkdir(parents=True, exist_ok=True)
        s.config.write_text(STARTER_CONFIG)
        print(f"wrote {s.config} (local = true; edit it to add a coordinator)")
    if s.kind != "systemd-system":
        s.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    print("then:\n" + "\n".join(f"  {c}" for c in s.manager_commands) + "\n  provider status")
    return 0


def uninstall(s: Service) -> int:
    if not s.unit.exists():
        print(f"provider: no service installed at {s.unit}", file=sys.stderr)
        return 1
    user = "" if s.kind == "systemd-system" else " --user"
    stop = (f"launchctl bootout gui/{os.getuid()} {s.unit}" if s.kind == "launchd"
            else f"systemctl{user} disable --now provider")
    print(f"stop it first if it runs: {stop}")
    s.unit.unlink()
    print(f"removed {s.unit} (config {s.config} and state {s.state_dir} are kept)")
    return 0


def status(s: Service, as_json: bool = False) -> int:
    """Whether the unit is installed and the daemon runs (exit 1 when not installed); with `as_json`, as one object."""
    pid = startup.holder_pid(s.state_dir)
    if as_json:
        print(json.dumps({"kind": s.kind, "unit": str(s.unit), "installed": s.unit.exists(),
                          "daemon_running": pid is not None, "daemon_pid": pid if pid and pid > 0 else None,
                          "state_dir": str(s.state_dir)}))
        return 0 if s.unit.exists() else 1
    print(f"{s.kind}: {'installed at ' + str(s.unit) if s.unit.exists() else 'not installed'} ({s.unit})")
    print(f"daemon: {'running, pid ' + str(pid) if pid else 'not running'} (state {s.state_dir})")
    if s.kind != "launchd" and shutil.which("systemctl") and s.unit.exists():
        user = [] if s.kind == "systemd-system" else ["--user"]
        subprocess.run(["systemctl", *user, "--no-pager", "status", "provider"], check=False)
    return 0 if s.unit.exists() else 1
