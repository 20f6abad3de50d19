"""Where and how to dial the coordinator: TLS for anything not on loopback unless explicitly allowed."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from provider.net import is_loopback

PLAINTEXT_SCHEMES = {"grpc", "http"}
TLS_SCHEMES = {"grpcs", "https"}

# Keepalive lets a dead coordinator (or NAT that dropped the flow) surface within ~30 s.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


class ChannelError(ValueError):
    """The coordinator URL is malformed or would send jobs in plaintext over a network."""


@dataclass(frozen=True)
class ChannelPlan:
    target: str  # host:port for grpc
    tls: bool
    host: str
    loopback: bool


def plan_channel(url: str, *, allow_insecure: bool = False) -> ChannelPlan:
    parsed = urlparse(url if "://" in url else f"//{url}")
    scheme = parsed.scheme.lower()
    if scheme and scheme not in PLAINTEXT_SCHEMES | TLS_SCHEMES:
        raise ChannelError(f"coordinator URL scheme {scheme!r} is not one of grpc, grpcs, http, https")
    host = parsed.hostname
    if not host:
        raise ChannelError(f"coordinator URL {url!r} has no host")
    try:
        port = parsed.port or (443 if scheme in TLS_SCHEMES or not scheme else 80)
    except ValueError:
        raise ChannelError(f"coordinator URL {url!r} has a bad port") from None
    loopback = is_loopback(host)
    tls = scheme in TLS_SCHEMES or (not scheme and not loopback)
    if not tls and not loopback and not allow_insecure:
        raise ChannelError(f"refusing a plaintext connection to {host}, which is not loopback; use grpcs:// "
                           "(TLS), or set allow_insecure_coordinator = true if the network is trusted")
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return ChannelPlan(target, tls, host, loopback)


def open_channel(plan: ChannelPlan, ca_file: str = ""):
    import grpc

    if not plan.tls:
        return grpc.aio.insecure_channel(plan.target, options=KEEPALIVE_OPTIONS)
    roots = open(ca_file, "rb").read() if ca_file else None  # None: the system's roots
    return grpc.aio.secure_channel(plan.target, grpc.ssl_channel_credentials(roots), options=KEEPALIVE_OPTIONS)
