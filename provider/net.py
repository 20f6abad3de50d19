"""Addresses: the one loopback rule, for the local API's bind address and the coordinator's URL alike."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses (IPv6 with or without brackets) and `localhost` count; any other name may
    resolve elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
