"""Whether the server that answers on a port is the process a test started.

A test picks a free port, then starts an engine that binds it seconds later (after its
imports). Another test's server can take the port in between; its /health then answers
for an engine that never bound, and the test would talk to the wrong server.
"""

from __future__ import annotations

import contextlib

import psutil


def listens_on(pid: int, port: int) -> bool:
    """Process `pid` or one of its children listens on TCP `port`."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in p.net_connections("tcp")):
                return True
    return False


def lost_its_port(log_text: str) -> bool:
    """The server's log says another process had bound its port first."""
    return "address already in use" in log_text.lower()
