"""A multi-node Ray cluster on one machine: a head without GPUs and nodes with their own IPs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import ray
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def simulated_nodes(ips: Sequence[str], *, cpus: int, gpus: int,
                    node_death_s: float | None = None) -> Iterator[Cluster]:
    """Nodes on `ips` (127.0.0.x) with `cpus` CPUs and `gpus` declared GPUs each, joined by
    this process; token auth stays on, with the session's token (tests/conftest.py).

    `node_death_s`: how long a node may miss Ray's health checks before Ray declares it
    dead (Ray's default is about 15 s), for tests that lose a node."""
    # No dashboard: nothing here submits a job, and it costs each cluster ~5 s to start.
    head: dict = {"num_cpus": 1, "num_gpus": 0, "include_dashboard": False}
    if node_death_s is not None:
        head["_system_config"] = {"health_check_period_ms": 1000,
                                  "health_check_failure_threshold": max(1, round(node_death_s))}
    c = Cluster(initialize_head=True, head_node_args=head)
    try:
        for ip in ips:
            c.add_node(num_cpus=cpus, num_gpus=gpus, node_ip_address=ip)
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
