"""Where an engine added mid-run goes: a free bundle of the job's placement groups, or a
placement group of its own on whatever capacity the cluster has now.

The job's placement group is sized at launch (`--rollout-num-gpus` is where a run starts);
its bundles are held by trainer slots, reserved slots and engines. A bundle is free once
the engine on it stopped (a drain) and no trainer slot shares it (colocated engines'
bundles never free up). An added engine takes free bundles first (the same node, GPU ids
consecutive); without them it gets a STRICT_PACK group of its own, which Ray places on any
node with room, a node that joined the cluster since included, waiting for one up to a
timeout. A group of its own goes back to the cluster when its engine stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from ray.util.placement_group import remove_placement_group

from slime_like.cluster.placement import JobPlacement, create_placement_group, probe_bundles
from slime_like.config.layout import Bundle, EnginePlacement, added_engine, consecutive_gpus
from slime_like.errors import PlacementError

logger = logging.getLogger(__name__)

Key = tuple[int, int]  # (placement group, bundle index)


class Capacity:
    """The bundles of a job's placement groups, which engine holds each, and new ones."""

    def __init__(self, placement: JobPlacement):
        self.placement = placement
        plan = placement.plan
        self._lock = threading.Lock()
        self._bundles: dict[Key, Bundle] = {(0, b.index): b for b in plan.bundles}
        self._holder: dict[Key, str] = {}
        for t in plan.trainer:
            self._holder[(0, t.bundle_index)] = "trainer"
        for where, start, size in plan.reserved_slots:
            for b in plan.bundles[start:start + size]:
                self._holder[(0, b.index)] = f"reserved by {where}"
        for p in plan.engines:
            self.hold(p.engine_id, [p])

    def hold(self, engine_id: str, placements: Iterable[EnginePlacement]) -> None:
        """Mark the bundles of an engine's placements as its own (a trainer slot stays so)."""
        with self._lock:
            for p in placements:
                for index in p.bundle_indices or (p.bundle_index,):
                    self._holder.setdefault((p.placement_group, index), engine_id)

    def moved(self, placements: Iterable[EnginePlacement]) -> None:
        """Ray placed these engine placements' bundles again (their node was lost): where
        they lie now, GPU ids consecutive from each `base_gpu_id`."""
        with self._lock:
            for p in placements:
                for offset, index in enumerate(p.bundle_indices or (p.bundle_index,)):
                    key = (p.placement_group, index)
                    if key in self._bundles:
                        self._bundles[key] = Bundle(index, p.node_ip, p.base_gpu_id + offset)

    def free(self) -> list[Key]:
        """Bundles no one holds, in slot order."""
        with self._lock:
            return [k for k in self._bundles if k not in self._holder]

    def take(self, template: EnginePlacement, engine_index: int,
             timeout_s: float) -> EnginePlacement:
        """A placement for one more engine like `template`: free bundles of the job's groups
        if there are enough on one node, else a group of its own (waits up to `timeout_s`
        for the cluster to have room; PlacementError when it has none by then)."""
        size = template.num_gpus
        with self._lock:
            chunk = self._free_chunk(size)
            if chunk is not None:
                group = chunk[0][0]
                placed = added_engine(template, [self._bundles[k] for k in chunk],
                                      engine_index, group)
                for k in chunk:
                    self._holder[k] = placed.engine_id
                return placed
        pg = create_placement_group(size, timeout_s=timeout_s, strategy="STRICT_PACK",
                                    name=f"{template.model_name}-added-e{engine_index}")
        try:
            bundles = probe_bundles(pg, size)
            if not consecutive_gpus(bundles):
                # Another group's bundles sit between this one's GPUs: an engine needs a run.
                raise PlacementError(
                    f"{template.model_name}: a new engine of {size} GPUs got GPUs "
                    f"{[b.gpu_id for b in bundles]} on {bundles[0].node_ip}, not consecutive")
        except BaseException:
            remove_placement_group(pg)
            raise
        with self._lock:
            group = self.placement.add_group(pg)
            placed = added_engine(template, bundles, engine_index, group)
            for b in bundles:
                self._bundles[(group, b.index)] = b
                self._holder[(group, b.index)] = placed.engine_id
        logger.info("%s: placement group %d of its own on %s (GPUs %s)", placed.engine_id,
                    group, placed.node_ip, list(placed.bundle_indices))
        return placed

    def _free_chunk(self, size: int) -> list[Key] | None:
        """`size` free bundles of one group, on one node with consecutive GPUs, or None."""
        free = [k for k in self._bundles if k not in self._holder]
        by_node: dict[tuple[int, str], list[Key]] = {}
        for k in free:
            by_node.setdefault((k[0], self._bundles[k].node_ip), []).append(k)
        for keys in by_node.values():
            keys.sort(key=lambda k: self._bundles[k].gpu_id)
            for i in range(len(keys) - size + 1):
                run = keys[i:i + size]
                if consecutive_gpus([self._bundles[k] for k in run]):
                    return run
        return None

    def release(self, engine_id: str) -> None:
        """The engine stopped: its bundles are free; a group of its own goes back to Ray."""
        with self._lock:
            mine = [k for k, holder in self._holder.items() if holder == engine_id]
            for k in mine:
                del self._holder[k]
            empty = {g for g, _ in mine if g != 0
                     and not any(k[0] == g for k in self._holder)}
            for g in empty:
                for k in [k for k in self._bundles if k[0] == g]:
                    del self._bundles[k]
        for g in empty:
            self.placement.remove_group(g)
