"""Which group this process belongs to, if any: the ring hostfile and this process's rank, from the settings
(`--group HOSTFILE --rank R`, `group_hostfile`/`group_rank`) or else MLX's own MLX_HOSTFILE/MLX_RANK. Pure:
files are read, nothing is connected."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .secret import GroupKey, GroupSecretError, load_secret, secret_path

MAX_RANKS = 64


class GroupSpecError(ValueError):
    """The group is described wrongly: a message for the operator, naming the file and what is wrong."""


@dataclass(frozen=True)
class GroupSpec:
    hostfile: Path
    hosts: tuple[tuple[str, ...], ...]  # per rank, the "ip:port" addresses it listens on
    rank: int
    backend: str  # "ring" or "jaccl"
    key: GroupKey = field(repr=False, compare=False)  # the group's secret: what every rank proves itself with

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def leader(self) -> bool:
        """Rank 0 holds the session, the local API, the tokenizer and every decision; the others follow it."""
        return self.rank == 0


def group_spec(hostfile: str, rank: int, backend: str, environ: Mapping[str, str], secret_file: str = ""
               ) -> GroupSpec | None:
    """The group these settings name, or None. A hostfile without a rank (or the reverse) is an error, and so is
    a group without its secret (`secret_file`, or the state directory's group-secret)."""
    if not hostfile and "MLX_HOSTFILE" in environ and "MLX_RANK" in environ:
        hostfile = environ["MLX_HOSTFILE"]
        rank = _rank(environ["MLX_RANK"], "MLX_RANK")
    elif hostfile and rank < 0:
        if "MLX_RANK" not in environ:
            raise GroupSpecError("--group names a hostfile but no rank: pass --rank R (or set group_rank or "
                                 "MLX_RANK)")
        rank = _rank(environ["MLX_RANK"], "MLX_RANK")
    if not hostfile:
        if rank >= 0:
            raise GroupSpecError("--rank needs --group HOSTFILE (or group_hostfile, or MLX_HOSTFILE)")
        return None
    path = Path(hostfile).expanduser()
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise GroupSpecError(f"cannot read the group hostfile {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise GroupSpecError(f"the group hostfile {path} is not JSON: {e}") from None
    hosts = parse_hosts(raw, str(path))
    if rank >= len(hosts):
        raise GroupSpecError(f"rank {rank} is not in {path}, which names {len(hosts)} ranks (0 to {len(hosts) - 1})")
    try:
        key = GroupKey(load_secret(secret_path(secret_file)), hosts)
    except GroupSecretError as e:
        raise GroupSpecError(str(e)) from None
    return GroupSpec(path, hosts, rank, backend, key)


# Tailscale and other carrier-grade NAT overlays (100.64.0.0/10) are WireGuard-encrypted links: private enough.
_SHARED = ipaddress.ip_network("100.64.0.0/10")


def public_addresses(hosts: tuple[tuple[str, ...], ...]) -> list[str]:
    """The hostfile's addresses outside private, loopback and link-local ranges: links MLX's ring would carry,
    unauthenticated and in plaintext, across networks the operator does not own."""
    out = []
    for address in (a for entry in hosts for a in entry):
        ip = ipaddress.ip_address(address.rpartition(":")[0].strip("[]"))
        if not (ip.is_private or ip.is_loopback or ip.is_link_local or (ip.version == 4 and ip in _SHARED)):
            out.append(address)
    return out


def parse_hosts(raw: object, where: str) -> tuple[tuple[str, ...], ...]:
    """MLX's ring hostfile: a JSON list with one entry per rank, each a list of "ip:port" (one per connection;
    every rank the same number)."""
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_RANKS:
        raise GroupSpecError(f"{where} must be a JSON list of 2 to {MAX_RANKS} ranks, each a list of \"ip:port\" "
                             "(MLX's ring hostfile), e.g. [[\"10.0.0.1:32323\"], [\"10.0.0.2:32323\"]]")
    hosts = []
    for r, entry in enumerate(raw):
        if isinstance(entry, str):
            entry = [entry]
        if not isinstance(entry, list) or not entry or not all(isinstance(a, str) for a in entry):
            raise GroupSpecError(f"{where}: rank {r} must be a non-empty list of \"ip:port\" strings")
        for address in entry:
            _check_address(address, f"{where}: rank {r}")
        hosts.append(tuple(entry))
    if len({len(h) for h in hosts}) != 1:
        raise GroupSpecError(f"{where}: every rank must list the same number of addresses (one per connection)")
    if len({a for h in hosts for a in h}) != sum(len(h) for h in hosts):
        raise GroupSpecError(f"{where}: an address is listed twice; each rank listens on addresses of its own")
    return tuple(hosts)


def _check_address(address: str, where: str) -> None:
    host, sep, port = address.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        ok = sep == ":" and 0 < int(port) < 65536
    except ValueError:
        ok = False
    if not ok:  # MLX's ring resolves no names: an address is an IP and a port
        raise GroupSpecError(f"{where}: {address!r} is not \"ip:port\" (an IP address, not a host name)")


def _rank(raw: str, name: str) -> int:
    try:
        rank = int(raw)
    except ValueError:
        rank = -1
    if rank < 0:
        raise GroupSpecError(f"{name} must be a rank, 0 or more (got {raw!r})")
    return rank
