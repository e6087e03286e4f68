"""A TP rank's weight groups: joining, leaving and abandoning them (the group endpoints).

The half of `WeightReceiver` that owns `groups` (weight group name -> process group): the
receives only look a group up by name, so a bucket's walk never enters this module.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from slime_like.protocol.socket_ifname import check_reachable
from slime_like.protocol.weight_group import (
    abort_process_group,
    check_store_listening,
    destroy_process_group,
    free_in_background,
    init_custom_process_group,
    tcp_init_method,
)

logger = logging.getLogger(__name__)

DEFAULT_GROUP_TIMEOUT_S = 600.0


class WeightGroups:
    """The weight groups of one TP rank (`WeightReceiver` sets `groups`, `freeing`,
    `tp_rank` and `device`)."""

    groups: dict[str, dist.ProcessGroup]
    tp_rank: int
    device: torch.device
    # Groups left and being freed: gloo closes a group about 10 ms a peer (0.16 s at 16),
    # which the leave's answer does not wait for (`weight_group.free_in_background`).
    freeing: list[threading.Thread]

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> tuple[bool, str]:
        """Join weight group `group_name` as rank rank_offset + tp_rank."""
        rank = rank_offset + self.tp_rank
        try:
            if backend == "nccl" and self.device.type != "cuda":
                raise ValueError("backend 'nccl' needs a CUDA engine; this engine runs on cpu "
                                 "(use backend 'gloo')")
            check_store_listening(master_address, master_port)
            # A wrong interface fails here in seconds, not in the rendezvous after minutes.
            choice = check_reachable(backend, [(master_address, master_port)],
                                     who=f"engine rank {rank}")
            if choice is not None:
                logger.info("weight group %s: rank %d binds %s; the trainer's store %s:%d "
                         "reached from it", group_name, rank, choice.describe(),
                         master_address, master_port)
            pg = init_custom_process_group(
                backend=backend, init_method=tcp_init_method(master_address, master_port),
                world_size=world_size, rank=rank, group_name=group_name,
                # No device_id, as sglang: a bound device makes NCCL connect eagerly inside
                # this call, which then blocks until the trainer's first collective, while
                # the trainer (like sglang's) waits for this call's answer before sending.
                timeout=timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - answered as sglang's 400 message
            return False, f"Failed to initialize custom process group: {e}."
        self.groups[group_name] = pg
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        """Leave a weight group; unknown names are sglang's 400."""
        pg = self.groups.pop(group_name, None)
        if pg is None:
            return False, "The group to be destroyed does not exist."
        destroy_process_group(pg)
        held = [pg]
        del pg  # the list is the last reference: the thread frees the group, not this call
        self._free(held)
        return True, "Succeeded to destroy custom process group."

    def _free(self, held: list[dist.ProcessGroup]) -> None:
        """Free a destroyed group on a thread; `held` is its last reference."""
        self.freeing = [t for t in self.freeing if t.is_alive()] + [free_in_background(held)]

    def join_freeing(self, timeout_s: float = 30.0) -> None:
        """Wait until every group left has been freed (shutdown: nothing outlives it)."""
        for thread in self.freeing:
            thread.join(timeout_s)
        self.freeing = []

    def destroy_all_groups(self) -> None:
        """Leave every weight group (shutdown)."""
        for name in list(self.groups):
            self.destroy_group(name)
        self.join_freeing()

    def abandon_group(self, group_name: str) -> None:
        """Abort and drop a group whose collective failed, closing its connections now."""
        pg = self.groups.pop(group_name, None)
        if pg is None:
            return
        abort_process_group(pg)
        destroy_process_group(pg)
        held = [pg]
        del pg
        self._free(held)  # the last reference gone, gloo closes its connections
        logger.warning("left weight group %s after a failed receive", group_name)
