"""Weight groups built like sglang's: two processes meet over TCP and broadcast over gloo."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from slime_like.cluster.ports import free_port
from slime_like.protocol.weight_group import (
    destroy_process_group,
    init_custom_process_group,
    tcp_init_method,
)


def _member(rank: int, port: int, group_names: list[str], out):
    import torch.distributed as dist

    results = []
    for name in group_names:
        pg = init_custom_process_group(backend="gloo", init_method=tcp_init_method("127.0.0.1", port),
                                       world_size=2, rank=rank, group_name=name, timeout=30)
        t = torch.arange(6, dtype=torch.float32) if rank == 0 else torch.zeros(6)
        dist.broadcast(t, src=0, group=pg)
        results.append(t.tolist())
        destroy_process_group(pg)
    out.put((rank, results))


def test_two_processes_broadcast_and_rebuild_under_a_new_group_name():
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, port, ["g1", "g2"], q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert got[1] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * 2


def test_ipv6_hosts_are_bracketed():
    assert tcp_init_method("::1", 5) == "tcp://[::1]:5"
    assert tcp_init_method("10.0.0.1", 5) == "tcp://10.0.0.1:5"


def test_the_weight_groups_store_listens_on_the_trainers_address_only():
    import os

    import psutil

    from slime_like.protocol.weight_group import host_store

    store = host_store(2, 5.0, host="127.0.0.1")
    listening = [c.laddr for c in psutil.Process(os.getpid()).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
    del store
