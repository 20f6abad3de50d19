"""`provider status --open`: a new one-time login link to the node's page (provider/local/dashboard.py), asked of
the running daemon over its control socket (0600: only the owner of the state directory gets one), printed, and
opened in this machine's browser when it has a display."""

from __future__ import annotations

import asyncio
import os
import sys

from .status_command import EXIT_NOT_RUNNING  # as `provider status`


def _can_open() -> bool:
    """A graphical browser can show the page here: macOS, or a display on Linux (never a console browser that
    would take over the terminal)."""
    return sys.platform == "darwin" or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run() -> int:
    from . import daemon_client

    try:
        status, body = asyncio.run(daemon_client.call("POST", "/ui/login-link", timeout=10))
    except daemon_client.Unreachable:
        print("provider: no daemon answers on its control socket; start one with `provider start --local`",
              file=sys.stderr)
        return EXIT_NOT_RUNNING
    if status != 200 or not isinstance(body, dict) or "url" not in body:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else str(body)
        print(f"provider: the daemon gave no page link ({status}): {message}", file=sys.stderr)
        return 1
    url = body["url"]
    expires = body.get("expires_in_s")
    print(url)
    print(f"(works once, within {expires / 60:.0f} minutes)" if expires else "(auth is off: this machine only)",
          file=sys.stderr)
    if _can_open():
        import webbrowser

        webbrowser.open(url)
    return 0
