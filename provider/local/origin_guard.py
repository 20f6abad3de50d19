"""Who may call the local API at all: a web page in a browser is a hostile client, even on 127.0.0.1.

Browsers send "simple" cross-origin requests (a POST with text/plain, a form) without a preflight, so an
OPTIONS-only check protects nothing; DNS rebinding points a page's own name at 127.0.0.1, and its requests then
arrive with that name as Host. So one middleware, ahead of auth and of every handler, on every method and route
(Ollama checks Origin on every request, Jupyter checks Host; this does both):

- Host must name the address the connection arrived at: that IP; on a loopback address also `localhost` and
  the other loopback literals (127.0.0.1, [::1]); on another address (a LAN bind, or 0.0.0.0 / ::) also this
  machine's host name (and its `.local` form); or a name in `allowed_hosts`. The port is not compared: an SSH
  tunnel or a port forward changes it, and a rebinding page cannot choose the name. Missing, repeated or
  malformed: 400 (RFC 9112); another name: 403 `host_not_allowed`. An absolute-form target
  (`GET http://name/...`) must name the node alike: its authority stands for the Host.
- A request that carries Origin is served only if that origin is in `cors_origins` or is the node's own
  (http://, a name Host may carry, the port the connection arrived at); without Origin, `Sec-Fetch-Site:
  cross-site` is refused alike: 403 `cors_disabled`. A same-site request without Origin (a page on another port
  of this host: a navigation, or a no-cors GET whose answer it cannot read) goes on to auth, where the page's
  cookie does not open it (dashboard.py). Clients that are not browsers (curl, the openai SDK) send neither.
- The control socket (0600, no browser can reach it) is exempt.

Refusals are RequestErrors, rendered in the shape of the route's surface by the server's error middleware
(Anthropic's under /v1/messages, OpenAI's elsewhere)."""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Callable

from aiohttp import web

from ..settings import Settings, host_name
from . import openai_api as api

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_PORT = re.compile(r":([0-9]{1,5})")
_ORIGIN = re.compile(r"([a-z][a-z0-9+.-]*)://(\[[^\]/]*\]|[^:/\[\]]*)(?::([0-9]{1,5}))?")


def over_control_socket(request: web.Request) -> bool:
    """Whether the request came over the control socket (the connection's own address family, which no header
    can fake): only the socket's owner can connect to it (0600), so it needs no token."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == getattr(socket, "AF_UNIX", None)


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's name (as settings.host_name spells it) and port, or None if it is malformed."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        name, rest = (value[1:end], value[end + 1:]) if end > 0 else ("", "")
        if ":" not in name:
            return None
    else:
        name, colon, rest = value.partition(":")
        rest = colon + rest
    port = None
    if rest:
        m = _PORT.fullmatch(rest)
        if m is None or int(m.group(1)) > 65535:
            return None
        port = int(m.group(1))
    name = host_name(name) if name else None
    return (name, port) if name else None


def _ip(text: str) -> IPAddress | None:
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    return (ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip


def machine_names(hostname: str | None = None) -> frozenset[str]:
    """This machine's host name as a LAN client may type it: as given, and with or without `.local`."""
    h = (socket.gethostname() if hostname is None else hostname).lower().rstrip(".")
    names = {h, h + ".local"} if "." not in h else {h, h[:-len(".local")]} if h.endswith(".local") else {h}
    return frozenset(n for n in map(host_name, names) if n)


class OriginGuard:
    def __init__(self, settings: Settings, hostnames: frozenset[str] | None = None):
        self.allowed_hosts = settings.allowed_host_names
        self.cors_origins = frozenset(settings.cors_origin_list)
        self.hostnames = machine_names() if hostnames is None else hostnames

    def host_ok(self, name: str, local: IPAddress) -> bool:
        """Whether `name` (a Host's, as split_host gives it) names a connection that arrived at `local`."""
        if name in self.allowed_hosts:
            return True
        ip = _ip(name)
        if ip is not None:
            return ip == local or (ip.is_loopback and local.is_loopback)
        return name == "localhost" if local.is_loopback else name in self.hostnames

    def origin_ok(self, origin: str, local: IPAddress, port: int) -> bool:
        origin = origin.strip().lower()
        if origin in self.cors_origins:
            return True
        m = _ORIGIN.fullmatch(origin)
        if m is None or m.group(1) != "http":
            return False
        name = host_name(m.group(2))
        return name is not None and int(m.group(3) or 80) == port and self.host_ok(name, local)

    def check(self, request: web.Request) -> None:
        """Raise the RequestError that refuses `request`, or return if it may go on."""
        if over_control_socket(request):
            return
        transport = request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        local = _ip(str(sockname[0])) if isinstance(sockname, tuple) and len(sockname) >= 2 else None
        if local is None:  # not a TCP connection this guard understands: refuse rather than guess
            raise api.RequestError("this connection's address is unknown", status=403, code="host_not_allowed",
                                   type_="permission_error")
        hosts = request.headers.getall("Host", [])
        parsed = split_host(hosts[0]) if len(hosts) == 1 else None
        if parsed is None:
            raise api.RequestError("the request needs exactly one well-formed Host header", status=400,
                                   code="invalid_host")
        target = request.message.url  # an absolute-form target's authority stands for the Host (RFC 9112 3.2.2)
        named = split_host(target.raw_authority) if target.is_absolute() else parsed
        if not (named is not None and self.host_ok(named[0], local) and self.host_ok(parsed[0], local)):
            raise api.RequestError(
                f"Host {hosts[0][:100]!r} does not name this node (DNS rebinding is refused); if it is one of its "
                "names, add it to allowed_hosts", status=403, code="host_not_allowed", type_="permission_error")
        origins = request.headers.getall("Origin", [])
        if origins:
            if len(origins) > 1 or not self.origin_ok(origins[0], local, sockname[1]):
                raise api.RequestError(
                    f"cross-origin requests from {origins[0][:100]!r} are not enabled on this node (cors_origins)",
                    status=403, code="cors_disabled", type_="permission_error")
        elif request.headers.get("Sec-Fetch-Site", "").strip().lower() == "cross-site":
            raise api.RequestError("cross-site requests are not enabled on this node (cors_origins)", status=403,
                                   code="cors_disabled", type_="permission_error")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        self.check(request)
        return await handler(request)
