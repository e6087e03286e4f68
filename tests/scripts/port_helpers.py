"""Holding a port the way another Ray cluster on the machine would."""

from __future__ import annotations

import socket

# Ports Ray takes at fixed defaults: the dashboard agent's HTTP port and the client server's.
RAY_FIXED_DEFAULT_PORTS = (52365, 10001)


def hold(port: int) -> socket.socket | None:
    """A listening socket on `port`; None when something already holds it (as good for us)."""
    s = socket.socket()
    try:
        s.bind(("", port))
        s.listen()
        return s
    except OSError:
        s.close()
        return None
