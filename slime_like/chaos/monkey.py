"""Fault plans and the monkey that fires them at their moments of the real job.

`--chaos-seed N` plans one fault per chosen step. Each fault is real: a SIGKILL of an
engine's server during a rollout or at a named step of a weight sync (armed in the
trainer's sync-step hook, fired through the engine's actor so it lands before the step
goes on), a SIGSTOP (a hang), a SIGKILL of the router, a whole node lost (its raylet
SIGKILLed, on a node of engines only). `--simulate-engine-crash-at` is a
plan of one fault. The `InvariantSampler` (invariants.py) watches from outside.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from slime_like.chaos.faults import (
    crash_at_sync_step,
    kill_engine,
    kill_node,
    kill_router,
    loseable_nodes,
    stop_engine,
)
from slime_like.chaos.partition import PARTITION, Partitioner
from slime_like.config.flags import CHAOS_FAULT_CHOICES
from slime_like.fleet.events import EngineState
from slime_like.fleet.fleet import Fleet
from slime_like.fleet.lifecycle import ManagedEngine

logger = logging.getLogger(__name__)

# fault -> the WeightSync step at whose start it fires (None: during the rollout)
FAULTS: dict[str, str | None] = {
    "kill_rollout": None,
    "kill_pause": "pause",
    "kill_transfer": "transfer",
    "kill_end": "end",
    "kill_continue": "continue",
    "stop_engine": None,
    "kill_router": None,
    "node": None,
    PARTITION: None,  # a host's link cut (partition.py)
}
assert tuple(FAULTS) == CHAOS_FAULT_CHOICES, "the flag's choices and the faults must agree"


@dataclass
class Fault:
    """One planned fault: at rollout step `step` (or the sync after it), on engine `engine`.

    A `pinned` fault hits engine `engine` of `model` (all of the model's engines counted,
    whatever their state) on node `node_rank`; otherwise `engine` picks among the
    updatable engines serving at that moment.
    """

    step: int
    kind: str
    engine: int
    fired_at: float | None = None
    target: str | None = None
    model: str | None = None
    node_rank: int = 0
    pinned: bool = False
    lost: list[str] = field(default_factory=list)  # a `node` fault: the engines it ran


def simulated_crash(step: int, model: str | None = None, node_rank: int = 0) -> Fault:
    """`--simulate-engine-crash-at STEP`: the first engine of `model` killed mid-rollout."""
    return Fault(step, "kill_rollout", 0, model=model, node_rank=node_rank, pinned=True)


def plan_faults(seed: int, kinds: list[str], num_steps: int, num_engines: int) -> list[Fault]:
    """One fault per chosen step, spread over the run; the last two steps stay quiet so every
    recovery finishes before the end."""
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        raise ValueError(f"unknown chaos fault(s) {unknown}; expected some of {list(FAULTS)}")
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    usable = list(range(1, max(2, num_steps - 2)))
    if len(order) > len(usable):
        raise ValueError(f"{len(order)} faults need at least {len(order) + 3} steps, got {num_steps}")
    stride = len(usable) / len(order)
    return [Fault(usable[int(i * stride)], kind, rng.randrange(num_engines))
            for i, kind in enumerate(order)]


class ChaosMonkey:
    """Fires the planned faults at their moments during the job."""

    def __init__(self, fleet: Fleet, faults: list[Fault], trainer: Any = None,
                 partitioner: Partitioner | None = None):
        self.fleet = fleet
        self.faults = faults
        self.trainer = trainer  # TrainerGroup: sync faults are armed in its rank 0
        self.partitioner = partitioner  # `partition` faults (partition.py)

    def _target(self, fault: Fault) -> ManagedEngine:
        if fault.pinned:
            pool = [e for e in self.fleet.engines if fault.model is None
                    or e.model_name == fault.model]
            return pool[fault.engine]
        live = [e for e in self.fleet.engines if e.update_weights
                and e.state in (EngineState.REGISTERED, EngineState.UPDATING)]
        engines = live or self.fleet.engines
        return engines[fault.engine % len(engines)]

    def _at(self, step: int, sync: bool) -> list[Fault]:
        return [f for f in self.faults if f.step == step and (FAULTS[f.kind] is not None) == sync]

    def rollout_hook(self, step: int, total: int) -> Callable[[int], None] | None:
        """An `on_sample` hook that fires this step's rollout fault a quarter of the way in."""
        faults = self._at(step, sync=False)
        if not faults:
            return None

        def on_sample(done: int) -> None:
            if done == max(1, total // 4):
                for f in faults:
                    threading.Thread(target=self._fire, args=(f,), daemon=True).start()
        return on_sample

    def _fire(self, f: Fault) -> None:
        f.fired_at = time.time()
        if f.kind == "kill_router":
            f.target = "router"
            kill_router(self.fleet)
            return
        if f.kind == "node":
            nodes = loseable_nodes(self.fleet)
            if not nodes:
                logger.error("chaos: node fault at step %d: no node of this run can be lost",
                             f.step)
                return
            node = nodes[f.engine % len(nodes)]
            f.target = f"node/{node}"
            f.lost = kill_node(self.fleet, node)
            logger.warning("chaos: node %s lost at step %d (engines %s)", node, f.step, f.lost)
            return
        if f.kind == PARTITION:
            self._partition(f)
            return
        e = self._target(f)
        f.target = e.engine_id
        if f.kind == "stop_engine":
            stop_engine(self.fleet, self.fleet.engines.index(e))
        else:
            kill_engine(self.fleet, self.fleet.engines.index(e), node_rank=f.node_rank)
        logger.warning("chaos: %s on %s at step %d", f.kind, f.target, f.step)

    def _partition(self, f: Fault) -> None:
        """Cut a partitionable engine host (seeded pick) for the configured length."""
        if self.partitioner is None:
            raise RuntimeError("a `partition` fault was planned without a partitioner")
        live = [e.engine_id for e in self.fleet.engines
                if e.state in (EngineState.REGISTERED, EngineState.UPDATING)]
        node_ip, f.target = self.partitioner.pick(f.engine, live)
        try:
            self.partitioner.cut(node_ip, f.target)
        except Exception:  # the fault did not land: its summary has no effect, and says so
            logger.exception("chaos: partition of %s failed", node_ip)

    def arm_sync(self, step: int) -> None:
        """Before the sync that follows `step`: arm its fault in the trainer (fired there)."""
        for f in self._at(step, sync=True):
            e = self._target(f)
            f.target, f.fired_at = e.engine_id, time.time()
            self.trainer.on_sync_step(FAULTS[f.kind], crash_at_sync_step(e))
            logger.warning("chaos: %s armed on %s for the sync after step %d", f.kind,
                           e.engine_id, step)

    def summary(self) -> list[dict]:
        """Each fault with what it caused: the death (and recovery) of its target seen after
        it was fired or armed, or the router's restart."""
        out = []
        for f in self.faults:
            row = asdict(f)
            if f.kind == "kill_router":
                row["effect"] = [r for r in self.fleet.router_restarts
                                 if f.fired_at and r.get("at", 0) >= f.fired_at]
            elif f.kind == PARTITION:
                row["effect"] = [c for c in (self.partitioner.cuts if self.partitioner else [])
                                 if c["engine"] == f.target and c["returncode"] == 0
                                 and f.fired_at and c["cut_at"] >= f.fired_at]
            else:
                hit = f.lost or [f.target]
                row["effect"] = [r for r in self.fleet.recoveries if r["engine"] in hit
                                 and f.fired_at and (r.get("dead_at") or 0) >= f.fired_at]
            out.append(row)
        return out
