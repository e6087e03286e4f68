"""Weight-update process groups, built exactly the way sglang builds them.

A weight group joins the trainer (rank 0, the broadcast source and TCP store host) with
every TP rank of every engine (`rank_offset + tp_rank`). Both sides must derive the same
store keys, so the group is made the way sglang's `init_custom_process_group` makes it: a
TCP rendezvous, the store wrapped in `PrefixStore(group_name)`, and a process group created
outside the default group (neither side needs `init_process_group` to have run).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import ipaddress
import socket
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def tcp_init_method(host: str, port: int) -> str:
    """`tcp://host:port`, with an IPv6 literal bracketed as torch's rendezvous requires."""
    try:
        if isinstance(ipaddress.ip_address(host.strip("[]")), ipaddress.IPv6Address):
            host = f"[{host.strip('[]')}]"
    except ValueError:
        pass  # a host name
    return f"tcp://{host}:{port}"


def _helper_kwargs(pg_options, device_id) -> dict:
    params = inspect.signature(c10d._new_process_group_helper).parameters
    kwargs = {}
    # torch renamed pg_options to backend_options in 2.6.
    kwargs["backend_options" if "backend_options" in params else "pg_options"] = pg_options
    if "device_id" in params:
        kwargs["device_id"] = device_id
    return kwargs


def init_custom_process_group(
    *,
    backend: str,
    init_method: str | None = None,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | float | None = None,
    pg_options=None,
    device_id: torch.device | None = None,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) the weight group `group_name`; blocks until all ranks meet.

    Give either `init_method` (`tcp://host:port`, as engines do) or a `store` the caller
    already hosts (`host_store`), which lets rank 0 bind port 0 instead of guessing a port.
    """
    if not group_name:
        raise ValueError("group_name must be a non-empty string")
    if (store is None) == (init_method is None):
        raise ValueError("give exactly one of init_method and store")
    timeout = _as_timedelta(timeout)
    timeout = timeout or c10d.default_pg_timeout
    if store is None:
        store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size,
                                                       timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
        timeout=timeout, **_helper_kwargs(pg_options, device_id),
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _as_timedelta(timeout: timedelta | float | None) -> timedelta | None:
    """Seconds (int or float) as a timedelta; a timedelta or None as given."""
    return timedelta(seconds=float(timeout)) if isinstance(timeout, int | float) else timeout


def host_store(world_size: int, timeout: timedelta | float, port: int = 0,
               host: str | None = None) -> dist.TCPStore:
    """A TCPStore for rank 0 (port 0: a free one, read back from `.port`), not waiting for peers.

    With `host` it listens on that address only (the trainer's, as the engines reach it),
    not on every interface of the machine.
    """
    timeout = _as_timedelta(timeout)
    if host is None:
        return dist.TCPStore("0.0.0.0", port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False)
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bare, port))
    sock.listen(128)
    bound = sock.getsockname()[1]
    # The store takes the listening socket over (it serves on that descriptor).
    return dist.TCPStore(bare, bound, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())


def join_store(host: str, port: int, world_size: int,
               timeout: timedelta | float) -> dist.TCPStore:
    """A client of a store that `host_store` serves: how rank 0 joins its own group.

    The master then stays with whoever hosts it alone, and dropping it closes the
    rendezvous for every rank still in it at once (rank 0's join included), instead of
    when rank 0's join gives up.
    """
    timeout = _as_timedelta(timeout)
    return dist.TCPStore(host.strip("[]"), port, world_size, is_master=False, timeout=timeout)


def abort_process_group(pg: dist.ProcessGroup | None) -> None:
    """Abort a weight group's pending collectives (NCCL ones cannot be cancelled otherwise)."""
    if pg is None:
        return
    with contextlib.suppress(Exception):
        abort = getattr(pg, "abort", None)
        if abort is not None:
            abort()
        else:
            c10d._abort_process_group(pg)


def destroy_process_group(pg: dist.ProcessGroup | None) -> None:
    """Tear a weight group down; a group that is already gone is not an error."""
    if pg is None:
        return
    with contextlib.suppress(ValueError, RuntimeError, KeyError):
        dist.destroy_process_group(pg)


def free_group(held: list[dist.ProcessGroup]) -> None:
    """Drop the last reference to the one group in `held` (already out of torch's
    registry): gloo closes its connections when the group is freed, about 10 ms a peer
    (each close waits for its transport loop's next tick, every 10 ms when idle), so a
    caller frees it on a thread of its own (`free_in_background`); the destructor runs
    without the GIL. Freed at once unless something still refers to it (a cycle): only
    then a full collection, which holds the GIL for a tenth of a second or more in a
    trainer's heap."""
    pg = held.pop()
    gone = weakref.ref(pg)
    del pg
    if gone() is not None:
        gc.collect()


FREE_THREAD_NAME = "weight-group-free"


def free_in_background(held: list[dist.ProcessGroup]) -> threading.Thread:
    """Free the group in `held` (destroyed already: out of torch's registry) on a daemon
    thread, so whoever leaves a group of N peers does not wait about N x 10 ms for gloo to
    close it. `held` must be the only reference: the thread empties it."""
    thread = threading.Thread(target=free_group, args=(held,), daemon=True,
                              name=FREE_THREAD_NAME)
    thread.start()
    return thread


def check_store_listening(host: str, port: int, timeout_s: float = 2.0) -> None:
    """Fail at once when the trainer's store is gone (sglang would retry the connect for the
    whole group timeout).

    The trainer creates its store before it asks anyone to join, so a refused connection
    means the attempt this join belonged to already failed and closed it: a join that
    waited behind a busy scheduler must not then block that scheduler for 600 s more.
    """
    try:
        socket.create_connection((host.strip("[]"), port), timeout=timeout_s).close()
    except ConnectionRefusedError as e:
        raise ConnectionError(f"the trainer's store at {host}:{port} is gone (the attempt this "
                              "join belonged to has ended)") from e
    except OSError:
        pass  # slow or unreachable: the rendezvous reports it, within the group timeout
