"""The node's own page, at the local API's root: what the node is doing now and over the last hour, and a chat
box to try a model (docs/operations.md#the-nodes-page).

Plain HTML, CSS and JavaScript shipped beside this module (provider/local/dashboard/), nothing fetched from
anywhere else. The page polls `GET /ui/state` once a second: the very snapshot `provider status --json` reads
(status_file.DaemonFacts.snapshot over the in-memory NodeStatus, never a model call), what the OS says of memory,
and the samples of the last hour it has not seen yet (page_history.py, one every 5 s, kept here).

Who sees it (page_access.py): the token holder, through a one-time login link that sets an HttpOnly,
SameSite=Strict session cookie; with `--no-auth`, the same machine only. The cookie opens the page's own calls
and nothing else (`COOKIE_PATHS`), only for requests that come from the page itself: Sec-Fetch-Site, when the
browser sends it, must say same-origin, and a request that changes anything must carry Origin (which the origin
guard has already checked is the node's own). Every answer carries a strict Content-Security-Policy."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import time
from pathlib import Path

from aiohttp import web

from ..node import Node
from ..status_file import DaemonFacts
from .origin_guard import over_control_socket
from .page_access import CODE_TTL_S, SESSION_TTL_S, PageAccess
from .page_history import SAMPLE_EVERY_S, History, Reading

ASSETS = Path(__file__).with_name("dashboard")
PAGE_KEY = web.AppKey("dashboard", object)
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Referrer-Policy": "no-referrer", "Cross-Origin-Opener-Policy": "same-origin",
           "Cross-Origin-Resource-Policy": "same-origin"}
# Served to anyone who passes the origin guard: the handler decides (the assets hold nothing of the node).
PUBLIC_PATHS = frozenset({"/", "/ui/login", "/ui/app.js", "/ui/charts.js", "/ui/style.css", "/ui/icon.svg"})
# What the session cookie opens besides: the page's own calls.
COOKIE_PATHS = frozenset({"/ui/state", "/v1/chat/completions", "/v1/models"})
STATE_CACHE_S = 0.25  # several open pages share one snapshot


def _loopback_peer(request: web.Request) -> bool:
    if over_control_socket(request):
        return True
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except (TypeError, ValueError, IndexError):
        return False
    return (ip.ipv4_mapped or ip).is_loopback if isinstance(ip, ipaddress.IPv6Address) else ip.is_loopback


def _port(request: web.Request) -> int:
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return int(sockname[1]) if isinstance(sockname, tuple) and len(sockname) >= 2 else 0


def _browsable(url: str) -> str:
    """A listening URL as a browser on this machine should open it (0.0.0.0 and [::] are no address to visit)."""
    return url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")


class Dashboard:
    def __init__(self, node: Node, token: str | None, facts: DaemonFacts | None = None):
        self.node = node
        self.access = PageAccess(token)
        self.facts = facts or DaemonFacts(pid=os.getpid(), started=time.time(), mode="local")
        self.history = History()
        self.assets = {name: (ASSETS / name).read_bytes()
                       for name in ("index.html", "login.html", "app.js", "charts.js", "style.css", "icon.svg")}
        self._state: tuple[float, dict] | None = None
        self._sampler: asyncio.Task | None = None
        self._process = None  # psutil's handle on this process, made at the first state asked for

    def add_routes(self, app: web.Application) -> None:
        app[PAGE_KEY] = self
        app.add_routes([
            web.get("/", self.index),
            web.get("/ui/login", self.login),
            web.post("/ui/login-link", self.login_link_route),
            web.get("/ui/state", self.state),
            web.get("/ui/app.js", self.asset),
            web.get("/ui/charts.js", self.asset),
            web.get("/ui/style.css", self.asset),
            web.get("/ui/icon.svg", self.asset),
        ])
        app.on_startup.append(self._start_sampler)
        app.on_cleanup.append(self._stop_sampler)

    # --- who is let in ----------------------------------------------------------------

    def signed_in(self, request: web.Request) -> bool:
        """Whether the request comes from the page of a signed-in browser (or, on a node without a token, from
        this machine)."""
        if self.access.open:
            return _loopback_peer(request)
        if over_control_socket(request):
            return True
        site = request.headers.get("Sec-Fetch-Site", "").strip().lower()
        safe = request.method in ("GET", "HEAD")
        if site not in ("", "same-origin") and not (safe and site == "none"):
            return False
        if not safe and "Origin" not in request.headers:
            return False
        return self.access.session_ok(request.cookies.get(self.access.cookie_name(_port(request))))

    def admits(self, request: web.Request) -> bool:
        """For the server's auth middleware: the page's own paths (their handlers decide), and the paths the
        session cookie opens when it is the page asking."""
        return request.path in PUBLIC_PATHS or (request.path in COOKIE_PATHS and self.signed_in(request))

    def login_link(self, url: str) -> str:
        url = _browsable(url)
        return f"{url}/" if self.access.open else f"{url}/ui/login?code={self.access.mint_code()}"

    # --- routes -------------------------------------------------------------------------

    def _page(self, name: str, status: int = 200, **headers: str) -> web.Response:
        kind = {"html": "text/html", "js": "text/javascript", "css": "text/css", "svg": "image/svg+xml"}
        cache = "no-store" if name.endswith(".html") else "no-cache"
        return web.Response(body=self.assets[name], status=status, content_type=kind[name.rsplit(".", 1)[1]],
                            charset=None if name.endswith(".svg") else "utf-8",
                            headers=HEADERS | {"Cache-Control": cache} | headers)

    async def index(self, request: web.Request) -> web.Response:
        if self.signed_in(request):
            return self._page("index.html")
        return self._page("login.html", status=403 if self.access.open else 401)

    async def asset(self, request: web.Request) -> web.Response:
        return self._page(request.path.rsplit("/", 1)[1])

    async def login(self, request: web.Request) -> web.Response:
        """A one-time link: spend its code, set the session cookie, and go to the page (whose address then no
        longer holds the code)."""
        response = web.Response(status=303, headers=HEADERS | {"Location": "/", "Cache-Control": "no-store"})
        if self.access.open:
            return response
        if not self.access.redeem(request.query.get("code", "")):
            return self._page("login.html", status=401)
        response.set_cookie(self.access.cookie_name(_port(request)), self.access.new_session(), path="/",
                            max_age=int(SESSION_TTL_S), httponly=True, samesite="Strict")
        return response

    async def login_link_route(self, request: web.Request) -> web.Response:
        """A new one-time link (`provider status --open`): for the bearer token or the control socket only; the
        session cookie does not open this."""
        if self.facts.local_url is None:
            return web.json_response({"error": {"message": "this node serves no local API, so it has no page",
                                                "code": "no_local_api"}}, status=409)
        return web.json_response({"url": self.login_link(self.facts.local_url),
                                  "expires_in_s": None if self.access.open else CODE_TTL_S})

    async def state(self, request: web.Request) -> web.Response:
        # With a token, the auth middleware let in the page's cookie or the bearer token; without one, this
        # machine only.
        if self.access.open and not self.signed_in(request):
            return web.json_response({"error": {"message": "this node's page answers its own machine only",
                                                "code": "not_this_machine"}}, status=403, headers=HEADERS)
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            since = 0
        body = self._snapshot() | {"history": self.history.since(since), "sample_every_s": SAMPLE_EVERY_S}
        return web.Response(text=json.dumps(body, default=str), content_type="application/json",
                            headers=HEADERS | {"Cache-Control": "no-store"})

    def _snapshot(self) -> dict:
        """The status file's snapshot of the in-memory status and the OS's view, made at most every
        STATE_CACHE_S whatever the number of pages polling."""
        now = time.monotonic()
        if self._state is not None and now - self._state[0] < STATE_CACHE_S:
            return self._state[1]
        import psutil

        vm, proc = psutil.virtual_memory(), self._process or psutil.Process()
        self._process = proc
        body = {"node": self.facts.snapshot(self.node.status()), "now": time.time(),
                "os": {"total_bytes": vm.total, "available_bytes": vm.available, "used_bytes": vm.total - vm.available,
                       "process_rss_bytes": proc.memory_info().rss, "load_average": list(os.getloadavg())}}
        self._state = (now, body)
        return body

    # --- the last hour ----------------------------------------------------------------

    def _read(self) -> None:
        st = self.node.status()
        self.history.add(Reading.of(st, self.node.metrics.ttft_buckets(), time.time()), st.active_jobs,
                         st.queued_jobs)

    async def _sample(self) -> None:
        while True:
            self._read()
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def _start_sampler(self, app: web.Application) -> None:
        self._sampler = asyncio.create_task(self._sample(), name="dashboard-sampler")

    async def _stop_sampler(self, app: web.Application) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler


def login_link(app: web.Application, url: str) -> str:
    """A new one-time login link to the page of the node `app` serves at `url` (its plain address without a
    token)."""
    return app[PAGE_KEY].login_link(url)
