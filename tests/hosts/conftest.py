"""Hosts with their own network stacks for the multi-node tests (needs root and sshd)."""

from __future__ import annotations

import os

import pytest

from tests.hosts.harness import Hosts, leftovers, requirements_missing

N_HOSTS = 3


def require_hosts() -> None:
    """Hosts need root and openssh-server (scripts/env.sh installs it as root). CI has both,
    so these tests never skip there: they skip only outside CI without root, and fail
    (saying what is missing) anywhere else."""
    why = requirements_missing()
    if why:
        if os.geteuid() != 0 and not os.environ.get("CI"):
            pytest.skip(f"multi-node hosts: {why} (run as root with openssh-server)")
        pytest.fail(f"multi-node hosts cannot be made: {why}", pytrace=False)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Three hosts on one bridge, each with its own sshd; nothing of them left afterwards."""
    require_hosts()
    h = Hosts(N_HOSTS, tmp_path_factory.mktemp("hosts"))
    with h:
        yield h
    assert leftovers(h.owner) == [], "namespaces or links of the hosts outlived them"
