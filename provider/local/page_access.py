"""Who may see the node's page (provider/local/dashboard.py): the holder of the local API's bearer token, and
nobody a browser could be tricked into acting for.

- A one-time login code, minted by the daemon (`provider start` prints a link with one; `provider status --open`
  asks the daemon for a new one over its 0600 control socket): random, kept only as its SHA-256, good for
  `CODE_TTL_S` and for one use; at most `MAX_CODES` outstanding (the oldest go first).
- Redeeming one sets the session cookie: `<issued>.<HMAC-SHA256>` under a key derived from the bearer token,
  so it survives a restart of the node (the page reconnects) and dies with the token (delete the token file
  and every session ends). HttpOnly (no script reads it), SameSite=Strict (no other site's page makes the
  browser send it), Path=/, for `SESSION_TTL_S`. Its name carries the port, so two nodes on one machine do not
  overwrite each other's.
- Without a token (`--no-auth`) the page answers the same machine only: a loopback peer.

Pure but for the clock and the random source: no I/O, no aiohttp."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from typing import Callable

CODE_TTL_S = 600.0
MAX_CODES = 16
SESSION_TTL_S = 7 * 86400.0
_KEY_LABEL = b"provider-node dashboard session v1\0"


class PageAccess:
    def __init__(self, token: str | None, clock: Callable[[], float] = time.time):
        self.token = token
        self._clock = clock
        self._key = hashlib.sha256(_KEY_LABEL + token.encode()).digest() if token is not None else b""
        self._codes: OrderedDict[bytes, float] = OrderedDict()  # sha256(code) -> expiry

    @property
    def open(self) -> bool:
        """No token: the page needs no login (the same machine only)."""
        return self.token is None

    @staticmethod
    def cookie_name(port: int) -> str:
        return f"provider_page_{port}"

    # --- one-time codes -------------------------------------------------------------

    def mint_code(self) -> str:
        now = self._clock()
        self._expire(now)
        while len(self._codes) >= MAX_CODES:
            self._codes.popitem(last=False)
        code = secrets.token_urlsafe(24)
        self._codes[_digest(code)] = now + CODE_TTL_S
        return code

    def redeem(self, code: str) -> bool:
        """Whether `code` is an outstanding code (it is spent either way)."""
        if self.token is None or not code or len(code) > 128:
            return False
        now = self._clock()
        self._expire(now)
        return self._codes.pop(_digest(code), None) is not None

    def _expire(self, now: float) -> None:
        for digest in [d for d, until in self._codes.items() if until <= now]:
            del self._codes[digest]

    # --- the session cookie ---------------------------------------------------------

    def new_session(self) -> str:
        issued = str(int(self._clock()))
        return f"{issued}.{self._mac(issued)}"

    def session_ok(self, value: str | None) -> bool:
        if self.token is None or not value or len(value) > 128:
            return False
        issued, dot, mac = value.partition(".")
        if not dot or not issued.isdigit() or not hmac.compare_digest(mac.encode(), self._mac(issued).encode()):
            return False
        age = self._clock() - int(issued)
        return -60.0 <= age <= SESSION_TTL_S  # a minute of clock step allowed

    def _mac(self, issued: str) -> str:
        return hmac.new(self._key, issued.encode(), hashlib.sha256).hexdigest()


def _digest(code: str) -> bytes:
    return hashlib.sha256(code.encode("utf-8", "surrogateescape")).digest()
