"""A multi-node Ray cluster on one machine: a head without GPUs and nodes with their own IPs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import ray
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def simulated_nodes(ips: Sequence[str], *, cpus: int, gpus: int) -> Iterator[Cluster]:
    """Nodes on `ips` (127.0.0.x) with `cpus` CPUs and `gpus` declared GPUs each, joined by
    this process; token auth stays on, with the session's token (tests/conftest.py)."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for ip in ips:
            c.add_node(num_cpus=cpus, num_gpus=gpus, node_ip_address=ip)
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
