"""Port reservation on the node where an engine's server will run (no probe-then-hope).

Two locks, each covering a gap the other leaves:

- a socket bound to the port (0.0.0.0 or ::, SO_REUSEADDR unset) keeps every process on the
  node, ours or not, from binding it while we hold it;
- an advisory `flock` on a node-local lock file per port keeps other slime_like reservers
  off it from the moment we close that socket (just before spawning the server) until the
  server has bound it (the caller says so with `handed_over()`).

The kernel drops both if the holder dies, so a crashed actor never leaks a reservation.
What neither can stop is a foreign process binding the port in the milliseconds between our
close and the server's bind; the engine treats "address already in use" at start-up as that
race and retries with new ports (bounded).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from slime_like.errors import LaunchError

# Below Linux's ephemeral range (32768+), where outgoing connections and port-0 binds of
# NCCL/gloo/torch would otherwise collide with ours, and above Ray's worker ports
# (10002-19999 by default).
DEFAULT_PORT_RANGE = (20000, 32000)
_random = random.SystemRandom()  # not the seeded global: seeded processes would pick alike


def _lock_dir() -> Path:
    d = Path(os.environ.get("SLIME_LIKE_PORT_LOCK_DIR") or Path(tempfile.gettempdir()) / "slime_like_ports")
    d.mkdir(parents=True, exist_ok=True)
    return d


class _Held:
    """One port: its bound socket and its lock file.

    Released at most once, under a lock: an engine actor's start-up and its shutdown may
    release the same reservation from two threads, and closing a descriptor twice could
    close a file that reused its number.
    """

    def __init__(self, port: int, sock: socket.socket, lock_fd: int):
        self.port = port
        self.sock: socket.socket | None = sock
        self.lock_fd: int | None = lock_fd
        self._lock = threading.Lock()

    def close_socket(self) -> None:
        with self._lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def unlock(self) -> None:
        self.close_socket()
        with self._lock:
            fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


def _try_hold(port: int, family: socket.AddressFamily) -> _Held | None:
    fd = os.open(_lock_dir() / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            # Dual-stack, so an IPv4 server on the same port is excluded too.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    except OSError as e:
        sock.close()
        os.close(fd)
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            return None
        raise
    return _Held(port, sock, fd)


class PortReservation:
    """Ports held on this node for one server: bound, then locked until the server binds them."""

    def __init__(self, heads: list[_Held], rest: list[_Held] | None = None):
        self._heads = heads
        self._held = heads + (rest or [])

    @property
    def ports(self) -> list[int]:
        """The first port of each reserved block (every port of a block is held)."""
        return [h.port for h in self._heads]

    def release_for_server(self) -> None:
        """Close the sockets (the server must bind the ports) but keep the lock files."""
        for h in self._held:
            h.close_socket()

    def handed_over(self) -> None:
        """The server has bound its ports (or is gone): drop everything."""
        for h in self._held:
            h.unlock()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc) -> None:
        self.handed_over()


def _candidates(start: int, end: int, skip: set[int]) -> Iterator[int]:
    # Start at a per-process offset so concurrent reservers rarely contend for one port.
    span = end - start
    offset = (os.getpid() * 7919) % span
    for i in range(span):
        port = start + (offset + i) % span
        if port not in skip:
            yield port


def reserve_ports(
    count: int = 1,
    *,
    consecutive: int = 1,
    host: str = "0.0.0.0",
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE,
    exclude: set[int] | None = None,
) -> PortReservation:
    """Hold `count` blocks of `consecutive` ports each (first port of each block in `.ports`
    order; a block's other ports are held too).

    `host` only picks the address family (an IPv6 host reserves on ::).
    """
    if count < 1 or consecutive < 1:
        raise ValueError(f"count={count} and consecutive={consecutive} must be >= 1")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    start, end = port_range
    skip = set(exclude or ())
    firsts: list[_Held] = []
    extra: list[_Held] = []
    for port in _candidates(start, end - consecutive + 1, skip):
        if len(firsts) == count:
            break
        if any(port <= p < port + consecutive for p in skip):
            continue
        block: list[_Held] = []
        for p in range(port, port + consecutive):
            h = _try_hold(p, family)
            if h is None:
                break
            block.append(h)
        if len(block) < consecutive:
            for h in block:
                h.unlock()
            continue
        firsts.append(block[0])
        extra.extend(block[1:])
        skip.update(range(port, port + consecutive))
    if len(firsts) < count:
        for h in firsts + extra:
            h.unlock()
        raise LaunchError(f"could not reserve {count} block(s) of {consecutive} free port(s) in "
                          f"{start}..{end} on {socket.gethostname()}")
    return PortReservation(firsts, extra)


def free_ports(count: int = 1, *, host: str = "0.0.0.0",
               port_range: tuple[int, int] = DEFAULT_PORT_RANGE) -> list[int]:
    """`count` distinct ports free on this node now, for servers the caller starts next.

    For a process that binds the port itself soon after (a test's engine, a TCP store).
    Drawn at random from `port_range`, not the kernel's port 0: the kernel hands port-0
    binds (gloo pairs, Ray's workers, other test processes) from the ephemeral range, and
    one of them could take a port picked there before our server binds it. A port another
    reserver holds is skipped. A launcher that can hold the port until the server binds it
    uses `reserve_ports` instead.
    """
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    start, end = port_range
    picked: list[int] = []
    for _ in range(100 * count):
        port = _random.randrange(start, end)
        if port in picked:
            continue
        held = _try_hold(port, family)
        if held is not None:
            held.unlock()
            picked.append(port)
            if len(picked) == count:
                return picked
    raise LaunchError(f"could not find {count} free port(s) in {start}..{end} on "
                      f"{socket.gethostname()}")


def free_port(host: str = "0.0.0.0") -> int:
    """One port free on this node now (see `free_ports`)."""
    return free_ports(1, host=host)[0]
