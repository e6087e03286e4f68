"""The weight group's socket interface: named by its variable, or the error says what to set.
Across hosts with their own network stacks (the wrong NIC for real): tests/hosts/."""

from __future__ import annotations

import pytest

from slime_like.protocol.socket_ifname import InterfaceError, check_reachable, socket_choice


def test_an_interface_this_host_lacks_is_named_with_the_ones_it_has(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    with pytest.raises(InterfaceError) as e:
        socket_choice("gloo")
    msg = str(e.value)
    assert "GLOO_SOCKET_IFNAME=eth9 names no interface with an address on this host" in msg
    assert "lo (127.0.0.1" in msg and "Set GLOO_SOCKET_IFNAME to the interface" in msg


def test_the_named_interface_and_its_address_are_what_the_group_binds(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    choice = socket_choice("gloo")
    assert (choice.ifname, choice.address) == ("lo", "127.0.0.1")
    assert choice.describe() == "127.0.0.1 on lo (GLOO_SOCKET_IFNAME=lo)"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=lo")  # NCCL's exact-name form
    assert socket_choice("nccl").ifname == "lo"


def test_nccl_without_its_variable_picks_for_itself(monkeypatch):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert socket_choice("nccl") is None


def test_engines_on_loopback_need_no_check(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # would fail if it were looked at
    assert check_reachable("gloo", [("127.0.0.1", 1), ("localhost", 2)], who="t") is None
