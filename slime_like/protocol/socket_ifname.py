"""The interface a weight group's sockets bind, and a bounded check that the peers reach it.

gloo (and NCCL's bootstrap) binds the address of `GLOO_SOCKET_IFNAME` (`NCCL_SOCKET_IFNAME`)
or, unset, the address this host's name resolves to (loopback when it resolves to none of
this host's). Each rank then tells the others that address through the store; on a node
with several NICs, the wrong one is reachable by no peer and every rank waits out the group
timeout (minutes) with no hint. Before joining, each side connects *from* that address to a
peer that already listens (the trainer to each engine's HTTP port, an engine to the
trainer's store): the reply can only come back if the peer's host routes to the address,
so a wrong interface fails in seconds with an error that names it, the addresses tried and
the variable to set.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil

IFNAME_VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
PROBE_TIMEOUT_S = 5.0


class InterfaceError(RuntimeError):
    """The weight group's socket interface is missing or unreachable from its peers."""


@dataclass(frozen=True)
class SocketChoice:
    """What this process's weight-group sockets bind: the interface, its address, and why."""

    variable: str        # the environment variable that picks it
    ifname: str          # the interface holding `address`
    address: str
    how: str             # "GLOO_SOCKET_IFNAME=clu0", or how gloo picked without it

    def describe(self) -> str:
        return f"{self.address} on {self.ifname} ({self.how})"


def _local_addresses() -> dict[str, list[str]]:
    """Interface -> its IPv4 and global IPv6 addresses."""
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET or (a.family == socket.AF_INET6
                                              and not a.address.startswith("fe80")):
                out.setdefault(name, []).append(a.address.split("%")[0])
    return out


def _interfaces_text(local: dict[str, list[str]]) -> str:
    return ", ".join(f"{n} ({' '.join(a)})" for n, a in sorted(local.items()))


def _named(value: str, backend: str, local: dict[str, list[str]]) -> list[str]:
    """The interfaces `value` names, in its order (NCCL: prefixes, `=` exact, `^` excludes)."""
    if backend == "nccl":
        exact = value.startswith("=")
        exclude = value.lstrip("=").startswith("^")
        items = [x for x in value.lstrip("=").lstrip("^").split(",") if x]
        def hit(name: str) -> bool:
            return any(name == x if exact else name.startswith(x) for x in items)
        return sorted(n for n in local if hit(n) != exclude)
    return [x for x in value.split(",") if x and x in local]


def socket_choice(backend: str) -> SocketChoice | None:
    """The address the `backend` group will bind here; None where it cannot be told (NCCL
    without NCCL_SOCKET_IFNAME picks for itself). InterfaceError if the variable names no
    interface of this host."""
    variable = IFNAME_VARIABLE.get(backend)
    if variable is None:
        return None
    value = os.environ.get(variable, "").strip()
    local = _local_addresses()
    if value:
        named = [n for n in _named(value, backend, local) if local.get(n)]
        if not named:
            raise InterfaceError(
                f"{variable}={value} names no interface with an address on this host "
                f"({socket.gethostname()}); its interfaces: {_interfaces_text(local)}. Set "
                f"{variable} to the interface the nodes reach each other on")
        return SocketChoice(variable, named[0], local[named[0]][0], f"{variable}={value}")
    if backend == "nccl":
        return None
    owner = {a: n for n, addrs in local.items() for a in addrs}
    host = socket.gethostname()
    try:
        resolved = [i[4][0] for i in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except OSError:
        resolved = []
    for address in resolved:
        if address in owner:
            return SocketChoice(variable, owner[address], address,
                                f"{variable} unset: this host's name {host} resolves to it")
    return SocketChoice(variable, owner.get("127.0.0.1", "lo"), "127.0.0.1",
                        f"{variable} unset and this host's name {host} resolves to none of "
                        "its addresses: gloo falls back to loopback")


def route_interface(host: str) -> str:
    """The interface (and address) the kernel's route to `host` leaves by, e.g. 'clu0 (10.1.2.3)'."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # sends nothing; only picks the route
            source = s.getsockname()[0]
        except OSError:
            return "?"
    name = next((n for n, a in _local_addresses().items() if source in a), "?")
    return f"{name} ({source})"


def _probe(source: str, host: str, port: int, timeout_s: float) -> str:
    """'' once a TCP connection from `source` to host:port is made, else why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.bind((source, 0))
            s.connect((host, port))
        return ""
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except OSError as e:
        return e.strerror or str(e)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def check_reachable(backend: str, peers: Sequence[tuple[str, int]], *, who: str,
                    timeout_s: float = PROBE_TIMEOUT_S) -> SocketChoice | None:
    """The choice, once every peer (host, port that listens) answered a connection from its
    address; InterfaceError naming the interface, the addresses tried and the variable to set
    when one did not (within `timeout_s`, all peers at once). None when every peer is on
    loopback (nothing to check) or the backend picks its interface itself."""
    remote = [(h.strip("[]"), p) for h, p in peers if not _is_loopback(h)]
    if not remote:
        return None
    choice = socket_choice(backend)
    if choice is None:
        return None
    with ThreadPoolExecutor(max_workers=min(16, len(remote))) as pool:
        answers = list(pool.map(lambda hp: _probe(choice.address, *hp, timeout_s), remote))
    failed = [(h, p, why) for (h, p), why in zip(remote, answers, strict=True) if why]
    if failed:
        tried = "; ".join(f"{choice.address} -> {h}:{p}: {why}" for h, p, why in failed)
        raise InterfaceError(
            f"{who}: the weight group's {backend} sockets bind {choice.describe()}, which "
            f"{len(failed)} of {len(remote)} peer(s) cannot reach (tried {tried}). Set "
            f"{choice.variable} to the interface the nodes reach each other on (the route to "
            f"{failed[0][0]} leaves by {route_interface(failed[0][0])}) on every node, e.g. "
            "with run_cluster.sh start")
    return choice
