"""A node lost: which of the fleet's nodes Ray has declared dead, and where their engines go.

A node's loss (a host reboots, a NIC flaps, a raylet dies) kills every engine on it at once;
each death reaches its recovery on its own (the exit watcher sees each actor die). Ray
reschedules the job's placement-group bundles of a dead node onto any node with room, one
that joins later included. So the relaunch of an engine whose node is gone first waits for
its bundles to be placed again, reads where they landed (the server's host and base GPU id
follow them) and launches there. Until a node has room the fleet runs smaller and says so
(one `WAITING_FOR_CAPACITY` per engine, and the log); the rest trains on meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import ray

from slime_like.cluster.placement import JobPlacement, wait_bundles
from slime_like.config.layout import Bundle, EnginePlacement, consecutive_gpus
from slime_like.errors import PlacementError
from slime_like.fleet.events import EventBus, Happening
from slime_like.fleet.lifecycle import ManagedEngine

logger = logging.getLogger(__name__)

# How long a relaunch waits for its bundles before it says the fleet runs smaller.
CAPACITY_NOTICE_S = 5.0


def node_subject(node_ip: str) -> str:
    """The timeline subject of a node's own events."""
    return f"node/{node_ip}"


def dead_nodes(node_ips: Sequence[str]) -> set[str]:
    """Those of `node_ips` on which Ray has no live node (one that rejoined is alive)."""
    alive = {n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")}
    return {ip for ip in node_ips if ip not in alive}


class NodeLoss:
    """Lost nodes seen by the fleet, and the re-placement of their engines."""

    def __init__(self, placement: JobPlacement, events: EventBus):
        self.placement = placement
        self.events = events
        self._announced: set[str] = set()
        self._lock = threading.Lock()
        self.waiting: set[str] = set()  # engines with no room yet: no end waits for them

    def lost_node(self, e: ManagedEngine) -> str | None:
        """The node of `e` Ray has declared dead, if one is (None for an external engine)."""
        if e.external_address is not None or not e.placements:
            return None
        dead = dead_nodes(sorted({p.node_ip for p in e.placements}))
        return min(dead) if dead else None

    def announce(self, node_ip: str, engines: Sequence[ManagedEngine]) -> None:
        """One `NODE_LOST` per loss of a node, naming the engines that were on it."""
        with self._lock:
            if node_ip in self._announced:
                return
            self._announced.add(node_ip)
        on_it = sorted(x.engine_id for x in engines
                       if any(p.node_ip == node_ip for p in x.placements))
        logger.warning("node %s is lost (Ray declared it dead): its engines %s are brought "
                       "back where there is room", node_ip, on_it)
        self.events.emit(node_subject(node_ip), Happening.NODE_LOST, node=node_ip,
                         engines=on_it)

    def placed_again(self, e: ManagedEngine, lost: str | None, *, stop: Callable[[], bool],
                     serving: Callable[[], tuple[int, int]]) -> list[EnginePlacement] | None:
        """`e`'s placements on the bundles Ray placed again, once it has (None if `stop()`
        turns true first). PlacementError if they landed where the engine cannot run (its
        GPUs split over nodes or not consecutive)."""
        def waiting(seconds: float) -> None:
            now, of = serving()
            logger.warning("%s: not placed %.0fs after %s: no node has room for it yet (it "
                           "needs %d free GPU(s) on one node); the fleet runs with %d of %d "
                           "engines meanwhile", e.engine_id, seconds,
                           f"node {lost} was lost" if lost else "its actor was lost",
                           sum(len(p.bundle_indices or (p.bundle_index,)) for p in e.placements),
                           now, of)
            self.waiting.add(e.engine_id)
            self.events.emit(e.engine_id, Happening.WAITING_FOR_CAPACITY, node_lost=lost,
                             serving=now, engines=of)

        placed: list[EnginePlacement] = []
        try:
            for p in e.placements:
                indices = list(p.bundle_indices or (p.bundle_index,))
                bundles = wait_bundles(self.placement.group(p.placement_group), indices,
                                       stop=stop, on_waiting=waiting,
                                       notice_s=CAPACITY_NOTICE_S)
                if bundles is None:
                    return None
                placed.append(self._moved(p, bundles))
        finally:
            self.waiting.discard(e.engine_id)
        head = next((p.node_ip for p in placed if p.node_rank == 0), None)
        if head is not None:  # a multi-node engine: every rank meets at node_rank 0's node
            placed = [dataclasses.replace(p, dist_init_host=head) if p.dist_init_host else p
                      for p in placed]
        with self._lock:
            self._announced -= {p.node_ip for p in placed}
        logger.warning("%s: placed on %s%s", e.engine_id, sorted({p.node_ip for p in placed}),
                       f" (node {lost} was lost)" if lost else " (its actor was lost, its "
                       "node lives on)")
        return placed

    @staticmethod
    def _moved(p: EnginePlacement, bundles: list[Bundle]) -> EnginePlacement:
        """`p` on `bundles` (the same bundle indices, wherever they are now)."""
        first = bundles[0]
        if len({b.node_ip for b in bundles}) > 1 or not consecutive_gpus(bundles):
            raise PlacementError(
                f"{p.engine_id}: its {len(bundles)} GPUs were placed again as (node, GPU) "
                f"{[(b.node_ip, b.gpu_id) for b in bundles]}, not consecutive GPUs of one "
                "node; it cannot run there")
        return dataclasses.replace(p, node_ip=first.node_ip, base_gpu_id=first.gpu_id)
