"""Host addresses: this node's IP as other nodes reach it, and URLs with IPv6 bracketed."""

from __future__ import annotations

import os
import socket


def format_host(host: str) -> str:
    """A host as it appears in a URL or `host:port`: IPv6 literals are bracketed."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def server_url(host: str, port: int) -> str:
    """`http://host:port` with IPv6 bracketed, as the router and clients expect."""
    return f"http://{format_host(host)}:{port}"


def node_ip(prefer_ipv6: bool | None = None) -> str:
    """This node's address as other nodes reach it (Ray's view; SLIME_LIKE_HOST_IP wins)."""
    override = os.environ.get("SLIME_LIKE_HOST_IP")
    if override:
        return override.strip("[]")
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # outside Ray, fall back to the route the kernel would use
        pass
    if prefer_ipv6 is None:
        prefer_ipv6 = os.environ.get("SLIME_LIKE_PREFER_IPV6", "0") == "1"
    family, probe = (socket.AF_INET6, "2001:4860:4860::8888") if prefer_ipv6 else (socket.AF_INET, "8.8.8.8")
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((probe, 80))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
        except OSError:
            return "::1" if prefer_ipv6 else "127.0.0.1"
