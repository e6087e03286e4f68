"""The faults themselves, done to a fleet's engines and routers as real crashes happen.

Only chaos runs and demos call these; the fleet never kills its own engines. External
engines are never killed by the job.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from slime_like.engine.actor import crash_server
from slime_like.errors import FleetError
from slime_like.fleet.fleet import Fleet
from slime_like.fleet.lifecycle import ManagedEngine
from slime_like.protocol import io_struct as p

logger = logging.getLogger(__name__)


def pick_engine(fleet: Fleet, index: int = 0, model: str | None = None) -> ManagedEngine:
    """Engine `index` among all engines, or among those of `model`."""
    pool = fleet.engines if model is None else [e for e in fleet.engines if e.model_name == model]
    return pool[index]


def kill_engine(fleet: Fleet, index: int = 0, *, model: str | None = None,
                node_rank: int = 0) -> str:
    """SIGKILL one engine's server, as a real crash would; its engine id.

    `index` counts all engines, or those of `model`; `node_rank` picks the node of a
    multi-node engine.
    """
    e = pick_engine(fleet, index, model)
    if e.external_address is not None:
        raise FleetError(f"{e.engine_id} is external: it is never killed by the job")
    crash_server(e.actors[node_rank], timeout=None)
    logger.warning("simulated a crash of %s node %d (%s)", e.engine_id, node_rank, e.url)
    return e.engine_id


def stop_engine(fleet: Fleet, index: int) -> str:
    """SIGSTOP one engine's server: a hang, found by probes, not by its exit."""
    e = fleet.engines[index]
    ray.get(e.actors[0].suspend.remote())
    logger.warning("suspended %s (%s)", e.engine_id, e.url)
    return e.engine_id


@ray.remote(num_cpus=0, max_retries=0)
def _kill_own_raylet() -> None:
    """Runs on the node to lose: SIGKILL to the raylet that started this worker, as a host's
    crash would do; every Ray process of the node (engine actors, their servers) dies with
    it and Ray declares the node dead once it misses its health checks."""
    raylet = psutil.Process(os.getppid())
    if "raylet" not in raylet.name():
        raise FleetError(f"chaos node: this worker's parent is {raylet.name()!r} "
                         f"(pid {raylet.pid}), not a raylet; refusing to kill it")
    raylet.kill()


def loseable_nodes(fleet: Fleet) -> list[str]:
    """Nodes whose loss the run can survive: they host engines of the updatable model and
    neither the trainer nor this driver (whose node also runs the routers)."""
    plan = fleet.placement.plan
    keep = {plan.bundles[t.bundle_index].node_ip for t in plan.trainer}
    keep.add(ray.util.get_node_ip_address())
    engines = {p.node_ip for e in fleet.engines if e.update_weights
               and e.external_address is None for p in e.placements}
    return sorted(engines - keep)


def kill_node(fleet: Fleet, node_ip: str) -> list[str]:
    """Lose a whole node (its raylet SIGKILLed there); the ids of the engines it ran."""
    if node_ip not in loseable_nodes(fleet):
        raise FleetError(f"chaos node: {node_ip} cannot be lost by this run (it hosts the "
                         f"trainer or the driver, or no engine); loseable: "
                         f"{loseable_nodes(fleet) or 'none'}")
    node_id = next((n["NodeID"] for n in ray.nodes()
                    if n.get("Alive") and n.get("NodeManagerAddress") == node_ip), None)
    if node_id is None:
        raise FleetError(f"chaos node: no live Ray node at {node_ip}")
    on_it = [e.engine_id for e in fleet.engines
             if any(p.node_ip == node_ip for p in e.placements)]
    ref = _kill_own_raylet.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    ray.wait([ref], timeout=10)  # it dies with the raylet: no answer is the expected one
    logger.warning("lost node %s (its raylet SIGKILLed) with engines %s", node_ip, on_it)
    return on_it


def kill_router(fleet: Fleet, model: str | None = None) -> None:
    """SIGKILL a router, as a real crash would."""
    fleet.routers[model or fleet.updatable_model].process.kill()


def crash_at_sync_step(e: ManagedEngine) -> Callable[[], None]:
    """What the trainer runs when its sync reaches the armed step: SIGKILL the engine's
    server (through its actor, so it has landed before the sync goes on)."""
    return functools.partial(crash_server, e.actors[0])


def revert_weights(fleet: Fleet, index: int = 0) -> str:
    """Put engine `index`'s weights back to the checkpoint it was launched from while its
    label keeps the fleet's version: an engine that claims weights it does not serve (a
    receiver that moved the label without the weights). Done through the engine's own
    `/update_weights_from_disk`; right after the first sync this is exactly one version
    behind. The log-probability check must fail the step naming it."""
    e = fleet.engines[index]
    if e.handle is None:
        raise FleetError(f"{e.engine_id} has no server to revert")
    path = fleet.settings.model_paths.get(e.model_name) or e.placements[0].model_path
    e.handle.update_weights_from_disk(p.UpdateWeightsFromDiskRequest(
        model_path=str(path), weight_version=str(fleet.version)))
    logger.warning("reverted %s (%s) to the weights of %s, label kept at version %s",
                   e.engine_id, e.url, path, fleet.version)
    return e.engine_id
