"""Port reservation: held bound until the server binds, locked against our own reservers."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slime_like.cluster.hosts import node_ip
from slime_like.cluster.ports import DEFAULT_PORT_RANGE, free_ports, reserve_ports
from slime_like.errors import LaunchError


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_reserved_ports_cannot_be_bound_by_anyone_else():
    with reserve_ports(3) as r:
        assert len(set(r.ports)) == 3
        for port in r.ports:
            assert not _can_bind(port)


def test_released_ports_bind_for_the_server_but_stay_locked_for_other_reservers():
    with reserve_ports(1) as r:
        port = r.ports[0]
        r.release_for_server()
        assert _can_bind(port)
        # Another slime_like actor on this node (another process) must not pick it meanwhile.
        code = ("from slime_like.cluster.ports import reserve_ports\n"
                f"reserve_ports(1, port_range=({port}, {port + 1}))")
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert other.returncode != 0 and "could not reserve" in other.stderr
    # Handed over: the lock is gone and the port is reservable again.
    with reserve_ports(1, port_range=(port, port + 1)) as again:
        assert again.ports == [port]


def test_a_taken_port_is_skipped():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with reserve_ports(1, port_range=(taken, taken + 50)) as r:
            assert r.ports[0] != taken


def test_consecutive_blocks_hold_every_port_of_the_block():
    with reserve_ports(2, consecutive=4) as r:
        a, b = r.ports
        assert abs(a - b) >= 4
        for port in [*range(a, a + 4), *range(b, b + 4)]:
            assert not _can_bind(port)


def test_exhausted_range_says_what_could_not_be_reserved():
    with reserve_ports(1) as r:
        port = r.ports[0]
        with pytest.raises(LaunchError, match=rf"1 block\(s\) of 1 free port\(s\) in {port}\.\.{port + 1}"):
            reserve_ports(1, port_range=(port, port + 1))


def test_ipv6_host_reserves_on_both_stacks():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    try:
        r = reserve_ports(1, host="::1")
    except OSError as e:
        pytest.skip(f"IPv6 sockets unavailable here: {e}")
    with r:
        assert not _can_bind(r.ports[0])


def test_node_ip_honours_the_override(monkeypatch):
    monkeypatch.setenv("SLIME_LIKE_HOST_IP", "[fd00::7]")
    assert node_ip() == "fd00::7"


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    """Picked below the kernel's port-0 range, so gloo, Ray and other tests' port-0 binds
    cannot take one between the pick and the server's bind."""
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(20)
    assert len(set(ports)) == 20
    for port in ports:
        assert DEFAULT_PORT_RANGE[0] <= port < min(DEFAULT_PORT_RANGE[1], lo)
        assert _can_bind(port)


def test_free_ports_skip_taken_ports_and_ports_a_launcher_holds():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(LaunchError, match=f"could not find 1 free port.*{taken}"):
            free_ports(1, port_range=(taken, taken + 1))
    with reserve_ports(1) as held:
        port = held.ports[0]
        held.release_for_server()  # bindable now, still locked until the server has it
        assert _can_bind(port)
        for _ in range(20):
            assert free_ports(1, port_range=(port, port + 3)) != [port]
