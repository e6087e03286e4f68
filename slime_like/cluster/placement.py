"""The Ray side of placement: one placement group, its bundles probed and sorted.

A probe task in each bundle reads the node IP and GPU id Ray gave it; the sorted bundles
feed the pure `layout.plan_job`. On CPU machines GPUs are declared to Ray (`ray start
--num-gpus N`, `ray.init(num_gpus=N)`), so the same code runs there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_like.config.layout import (
    Bundle,
    EnginePlacement,
    JobPlan,
    PlacementGroupLayout,
    plan_job,
    sort_bundles,
)
from slime_like.config.slices import PlacementSettings
from slime_like.config.topology import Topology
from slime_like.errors import PlacementError

logger = logging.getLogger(__name__)

BUNDLE = {"GPU": 1, "CPU": 1}
# slime's fractions: under --colocate a trainer rank and an engine actor share one bundle.
TRAINER_ACTOR_GPUS = 0.4
ENGINE_ACTOR_GPUS = 0.2


# A task, not an actor, and max_calls=0: Ray's default for a GPU task (max_calls=1) ends its
# worker process after it, and an actor has a process of its own. So the probe runs in a
# pooled worker that is then given to the job's actors, rather than starting a process per
# bundle only to kill it (at 64 engines, 64 interpreters started for one answer each). The
# probe never touches a GPU, so its worker holds no device memory afterwards.
@ray.remote(num_cpus=0, num_gpus=1, max_calls=0)
def _where_bundle() -> tuple[str, list, str]:
    """Runs in one bundle just long enough to say where Ray put it."""
    return (ray.util.get_node_ip_address(), list(ray.get_gpu_ids()),
            ray.get_runtime_context().get_node_id())


def _probe(pg: PlacementGroup, indices: list[int]) -> list[ray.ObjectRef]:
    return [_where_bundle.options(scheduling_strategy=bundle_strategy(pg, i)).remote()
            for i in indices]


def _cancel(refs: list[ray.ObjectRef]) -> None:
    """Probes still waiting for their bundle are not run."""
    for ref in refs:
        ray.cancel(ref)


def bundle_strategy(pg: PlacementGroup, bundle_index: int) -> PlacementGroupSchedulingStrategy:
    """Scheduling strategy that puts an actor (and its child tasks) in one bundle."""
    return PlacementGroupSchedulingStrategy(placement_group=pg,
                                            placement_group_bundle_index=bundle_index,
                                            placement_group_capture_child_tasks=True)


def _cluster_gpus() -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    return (f"the cluster has {total.get('GPU', 0):g} GPUs and {total.get('CPU', 0):g} CPUs, "
            f"{free.get('GPU', 0):g} GPUs and {free.get('CPU', 0):g} CPUs free")


def create_placement_group(num_bundles: int, *, timeout_s: float | None = None,
                           log_every_s: float = 30.0, name: str = "",
                           strategy: str = "PACK") -> PlacementGroup | None:
    """A placement group of `num_bundles` {GPU:1, CPU:1} bundles (PACK, or STRICT_PACK for
    one engine's GPUs on one node), once it is ready.

    Without a timeout it waits as long as the autoscaler needs, logging what it waits for
    (a node that joins the cluster meanwhile is capacity it takes); with one it removes the
    group and raises PlacementError when time is up.
    """
    if num_bundles == 0:
        return None
    pg = placement_group([dict(BUNDLE) for _ in range(num_bundles)], strategy=strategy,
                         name=name)
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    while True:
        step = log_every_s if deadline is None else max(0.0, min(log_every_s,
                                                                 deadline - time.monotonic()))
        ready, _ = ray.wait([pg.ready()], timeout=step)
        if ready:
            ray.get(ready[0])
            return pg
        waited = time.monotonic() - start
        if deadline is not None and time.monotonic() >= deadline:
            remove_placement_group(pg)
            raise PlacementError(f"placement group of {num_bundles} {BUNDLE} bundles not ready "
                                 f"after {waited:.0f}s: {_cluster_gpus()}")
        logger.info("waiting %.0fs for a placement group of %d %s bundles: %s", waited,
                    num_bundles, BUNDLE, _cluster_gpus())


def wait_bundles(pg: PlacementGroup, indices: list[int], *, stop: Callable[[], bool],
                 on_waiting: Callable[[float], None], notice_s: float = 5.0,
                 poll_s: float = 0.5) -> list[Bundle] | None:
    """Where bundles `indices` of `pg` are now, once Ray has placed them (again).

    After a node's death Ray reschedules its bundles onto any node with room, one that
    joins later included; until then a probe in one waits. `on_waiting(seconds)` is called
    once when they have waited `notice_s`; None if `stop()` turns true first.
    """
    refs = _probe(pg, indices)
    start, noticed = time.monotonic(), False
    while True:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=poll_s)
        if len(ready) == len(refs):
            break
        if stop():
            _cancel(refs)
            return None
        waited = time.monotonic() - start
        if not noticed and waited >= notice_s:
            noticed = True
            on_waiting(waited)
    answers = ray.get(refs)
    return [Bundle(i, ip, int(gpu_ids[0]) if gpu_ids else 0, node_id)
            for i, (ip, gpu_ids, node_id) in zip(indices, answers, strict=True)]


def probe_bundles(pg: PlacementGroup | None, num_bundles: int, *,
                  timeout_s: float = 120.0) -> list[Bundle]:
    """Every bundle's (node IP, GPU id), read by a probe task inside it; sorted by slot."""
    if pg is None:
        return []
    refs = _probe(pg, list(range(num_bundles)))
    try:
        answers = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        _cancel(refs)
        raise PlacementError(f"bundle probes did not answer within {timeout_s:g}s") from None
    bundles = []
    for i, (ip, gpu_ids, node_id) in enumerate(answers):
        if len(gpu_ids) != 1:
            raise PlacementError(f"bundle {i} on {ip}: expected one GPU id, Ray gave {gpu_ids}")
        try:
            gpu_id = int(gpu_ids[0])
        except (TypeError, ValueError):
            raise PlacementError(f"bundle {i} on {ip}: GPU id {gpu_ids[0]!r} is not an "
                                 "integer index") from None
        bundles.append(Bundle(i, ip, gpu_id, node_id))
    return sort_bundles(bundles)


@dataclass
class JobPlacement:
    """The job's placement group and the plan over it; `release()` gives the GPUs back.

    Engines added mid-run may get placement groups of their own (`add_group`); an
    `EnginePlacement` names its group by index (0: the job's own)."""

    pg: PlacementGroup | None
    plan: JobPlan
    added: dict[int, PlacementGroup] = field(default_factory=dict)

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options for trainer rank `rank`."""
        slot = self.plan.trainer[rank]
        return {"num_gpus": TRAINER_ACTOR_GPUS, "num_cpus": TRAINER_ACTOR_GPUS,
                "scheduling_strategy": bundle_strategy(self.group(), slot.bundle_index)}

    def engine_options(self, engine: EnginePlacement) -> dict[str, Any]:
        """Ray actor options for one engine actor."""
        return {"num_gpus": ENGINE_ACTOR_GPUS, "num_cpus": ENGINE_ACTOR_GPUS,
                "scheduling_strategy": bundle_strategy(self.group(engine.placement_group),
                                                       engine.bundle_index)}

    def group(self, index: int = 0) -> PlacementGroup:
        pg = self.pg if index == 0 else self.added.get(index)
        if pg is None:
            raise PlacementError("this job has no placement group (it places no GPUs)"
                                 if index == 0 else f"placement group {index} was released")
        return pg

    def add_group(self, pg: PlacementGroup) -> int:
        """Hold a placement group made for added engines; its index."""
        index = max(self.added, default=0) + 1
        self.added[index] = pg
        return index

    def remove_group(self, index: int) -> None:
        """Give an added group's GPUs back (its engines stopped)."""
        pg = self.added.pop(index, None)
        if pg is not None:
            remove_placement_group(pg)

    def release(self) -> None:
        """Remove the placement groups; actors still in them are killed by Ray."""
        for index in list(self.added):
            self.remove_group(index)
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def __enter__(self) -> JobPlacement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def place(topology: Topology, layout: PlacementGroupLayout, *, timeout_s: float | None = None,
          probe_timeout_s: float = 120.0, name: str = "") -> JobPlacement:
    """Create the placement group, probe it, and plan the job over its sorted bundles."""
    pg = create_placement_group(layout.num_bundles, timeout_s=timeout_s, name=name)
    try:
        bundles = probe_bundles(pg, layout.num_bundles, timeout_s=probe_timeout_s)
        return JobPlacement(pg, plan_job(topology, bundles, layout))
    except BaseException:
        if pg is not None:
            remove_placement_group(pg)
        raise


def place_job(settings: PlacementSettings, *, timeout_s: float | None = None) -> JobPlacement:
    """`place` for the job's placement slice (`config.slices.placement_settings`)."""
    return place(settings.topology, settings.layout, timeout_s=timeout_s)
