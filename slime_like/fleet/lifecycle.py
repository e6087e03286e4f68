"""The engine lifecycle: the legal moves between phases, and one engine's whole record.

    LAUNCHING -> LOADED -> UPDATING -> REGISTERED <-> UPDATING_ROUTED (a sync in place)
    REGISTERED -> SUSPECT (a failed probe: out of the router) -> REGISTERED | STALE | DEAD
    UPDATING -> SUSPECT (a weight sync found it hung: out of the router, weights unknown)
        -> STALE (it answers again: resync) | DEAD (the health monitor's verdict)
    UPDATING -> STALE (a sync that did not verify it: out of the router) -> UPDATING
    REGISTERED -> OFFLOADED (memory released for a colocated train step: out of the router)
        -> REGISTERED | STALE | AWAITING_SYNC (weights dropped) | HELD (kept idle for the
           sync right after) -> UPDATING
    any -> DEAD -> RELAUNCHING | REATTACHING (an external engine) -> STALE -> UPDATING
        -> REGISTERED, or DEAD -> LOST (its recovery gave up)
    LOADED -> STALE (an engine added to a fleet that serves a version: it resyncs)
    REGISTERED | SUSPECT | LOADED | STALE -> DRAINING (out of the router; its running
        requests finish or are moved) -> DRAINED (waits for the next regroup) -> STOPPED
    any -> STOPPED (shutdown)

The phase is the whole truth of an engine: whether it is in its router (`ROUTED`), whether
a sync needs to pause it, whether it waits for the next full sync or gets a resync of its
own. Several phases share the `EngineState` events and views name them by
(UPDATING_ROUTED is UPDATING, AWAITING_SYNC and HELD are STALE, LOST is DEAD, DRAINED is
DRAINING), so the timeline reads as before. Invariant: an engine is in its router only while its verified
weight version equals the fleet's current version (see docs/ARCHITECTURE.md). Only the
fleet moves engines; `move` refuses anything not in `TRANSITIONS`, so an illegal move is a
bug that shows at once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from slime_like.config.fleet_slices import FleetSettings
from slime_like.config.layout import EnginePlacement, JobPlan
from slime_like.engine.from_placement import engine_config
from slime_like.engine.session import EngineSession
from slime_like.errors import SlimeLikeError
from slime_like.fleet.events import EngineState
from slime_like.protocol.weight_version import WeightVersion

S = EngineState


class Phase(enum.Enum):
    """A row of the lifecycle table; `state` is the name events and views give it."""

    LAUNCHING = "LAUNCHING"
    LOADED = "LOADED"
    UPDATING = "UPDATING"                # synced out of its router
    UPDATING_ROUTED = "UPDATING_ROUTED"  # a serving engine synced in place, still routed
    REGISTERED = "REGISTERED"            # routed at the fleet's version
    SUSPECT = "SUSPECT"
    OFFLOADED = "OFFLOADED"
    STALE = "STALE"                      # not at the fleet's version: a resync of its own
    AWAITING_SYNC = "AWAITING_SYNC"      # STALE until the next full sync takes it along
    HELD = "HELD"                        # AWAITING_SYNC, idle since its memory came back:
    #                                      that sync need not pause or continue it
    DEAD = "DEAD"                        # its recovery runs
    RELAUNCHING = "RELAUNCHING"
    REATTACHING = "REATTACHING"
    LOST = "LOST"                        # DEAD for good: its recovery gave up
    DRAINING = "DRAINING"                # leaving: unrouted, its running requests end
    DRAINED = "DRAINED"                  # DRAINING, idle: stops once the weight group
    #                                      is rebuilt without it (the next full update)
    STOPPED = "STOPPED"

    @property
    def state(self) -> EngineState:
        return _STATE.get(self) or EngineState(self.value)


P = Phase
_STATE = {P.UPDATING_ROUTED: S.UPDATING, P.AWAITING_SYNC: S.STALE, P.HELD: S.STALE,
          P.LOST: S.DEAD, P.DRAINED: S.DRAINING}
_DOWN = frozenset({P.DEAD, P.STOPPED})
_LEAVE = frozenset({P.DRAINING})  # a drain: the engine leaves the fleet
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    P.LAUNCHING: frozenset({P.LOADED}) | _DOWN,
    P.LOADED: frozenset({P.UPDATING, P.STALE}) | _DOWN | _LEAVE,
    P.UPDATING: frozenset({P.REGISTERED, P.STALE, P.SUSPECT}) | _DOWN,
    P.UPDATING_ROUTED: frozenset({P.REGISTERED, P.STALE, P.UPDATING, P.SUSPECT}) | _DOWN,
    P.REGISTERED: frozenset({P.UPDATING_ROUTED, P.SUSPECT, P.STALE, P.OFFLOADED}) | _DOWN
    | _LEAVE,
    P.SUSPECT: frozenset({P.REGISTERED, P.STALE}) | _DOWN | _LEAVE,
    P.OFFLOADED: frozenset({P.REGISTERED, P.STALE, P.AWAITING_SYNC, P.HELD}) | _DOWN,
    P.STALE: frozenset({P.UPDATING}) | _DOWN | _LEAVE,
    P.AWAITING_SYNC: frozenset({P.UPDATING, P.STALE}) | _DOWN | _LEAVE,
    P.HELD: frozenset({P.UPDATING, P.STALE}) | _DOWN | _LEAVE,
    P.DEAD: frozenset({P.RELAUNCHING, P.REATTACHING, P.LOST, P.STOPPED}),
    P.RELAUNCHING: frozenset({P.STALE}) | _DOWN,
    P.REATTACHING: frozenset({P.STALE}) | _DOWN,
    P.LOST: frozenset({P.STOPPED}),
    # Leaving: a death is no news (nothing relaunches it), so only STOPPED follows.
    P.DRAINING: frozenset({P.DRAINED, P.STOPPED}),
    P.DRAINED: frozenset({P.STOPPED}),
    P.STOPPED: frozenset(),
}

# In its router (entering one of these adds it, leaving removes it: `Fleet.move`).
ROUTED: frozenset[Phase] = frozenset({P.REGISTERED, P.UPDATING_ROUTED})
# Phases an update may take an engine from (to UPDATING, or UPDATING_ROUTED if routed).
SYNCABLE: frozenset[Phase] = frozenset({P.LOADED, P.REGISTERED, P.STALE, P.AWAITING_SYNC,
                                        P.HELD})
# Waiting for the next full sync: no resync of their own; any full update ends the wait.
FOR_FULL_SYNC: frozenset[Phase] = frozenset({P.AWAITING_SYNC, P.HELD})
# Dead, on its way back, or given up: a death seen now is no news.
GONE: frozenset[Phase] = frozenset({P.DEAD, P.RELAUNCHING, P.REATTACHING, P.LOST, P.STOPPED})
# Leaving the fleet (`fleet.drain`): never synced, probed or recovered again.
LEAVING: frozenset[Phase] = frozenset({P.DRAINING, P.DRAINED})
# A drain may take an engine from these (one in a weight update is waited for first).
DRAINABLE: frozenset[Phase] = frozenset(p for p, to in TRANSITIONS.items() if P.DRAINING in to)
# Probed by the health monitor (a STOPPED or dead engine is not) ...
WATCHED: frozenset[Phase] = frozenset({P.REGISTERED, P.SUSPECT, P.LOADED, P.STALE,
                                       P.AWAITING_SYNC, P.HELD, P.UPDATING, P.UPDATING_ROUTED,
                                       P.OFFLOADED})
# ... with /ping only: paused for a sync, released, or held idle for the sync that follows.
PING_ONLY: frozenset[Phase] = frozenset({P.UPDATING, P.UPDATING_ROUTED, P.OFFLOADED, P.HELD})


class IllegalTransition(SlimeLikeError):
    """A move the lifecycle table does not allow (a bug in the caller)."""

    def __init__(self, engine_id: str, src: Phase, dst: Phase):
        self.engine_id, self.src, self.dst = engine_id, src, dst
        super().__init__(f"engine {engine_id}: illegal lifecycle move {src.value} -> {dst.value}")

    def __reduce__(self):
        return (type(self), (self.engine_id, self.src, self.dst))


@dataclass
class ManagedEngine:
    """One engine of the fleet (all its node actors) and everything the fleet knows of it."""

    engine_id: str
    model_name: str
    placements: list[EnginePlacement]
    update_weights: bool
    tp_size: int = 1
    external_address: str | None = None  # attached, never launched or killed by us
    actors: list[Any] = field(default_factory=list)
    handle: EngineSession | None = None
    phase: Phase = Phase.LAUNCHING
    verified_version: WeightVersion | None = None
    router_worker_id: str | None = None  # the router's name for it while it is a worker
    restarts: int = 0  # launches after the first: an exit of an older server is not news
    dead_at: float | None = None

    @property
    def state(self) -> EngineState:
        """What events and views call its phase."""
        return self.phase.state

    @property
    def routed(self) -> bool:
        return self.phase in ROUTED

    @property
    def url(self) -> str | None:
        return self.handle.url if self.handle else None

    @property
    def colocated(self) -> bool:
        """On the trainer's GPUs: it gives its memory back around each train step."""
        return (self.external_address is None and bool(self.placements)
                and self.placements[0].shares_trainer_gpus)

    def check(self, dst: Phase) -> None:
        """IllegalTransition unless the table allows the move to `dst`."""
        if dst not in TRANSITIONS[self.phase]:
            raise IllegalTransition(self.engine_id, self.phase, dst)

    def move(self, dst: Phase) -> Phase:
        """Change phase if the table allows it; the previous phase."""
        self.check(dst)
        src, self.phase = self.phase, dst
        if dst is Phase.DEAD:
            self.dead_at = time.time()
        return src


def record_of(placements: list[EnginePlacement], settings: FleetSettings,
              update_weights: bool) -> ManagedEngine:
    """The record of one engine of ours (its node placements, node rank 0 first)."""
    ps = sorted(placements, key=lambda p: p.node_rank)
    path = settings.model_paths.get(ps[0].model_name) or ps[0].model_path or ""
    cfg = engine_config(ps[0], settings.engine, model_path=path)
    return ManagedEngine(ps[0].engine_id, ps[0].model_name, ps, update_weights,
                         tp_size=max(1, ps[0].num_gpus // cfg.pp_size))


def records_from_plan(plan: JobPlan, settings: FleetSettings) -> list[ManagedEngine]:
    """One record per engine of the plan (all its node placements), then the external ones."""
    engines: list[ManagedEngine] = []
    for router in plan.routers:
        by_engine: dict[int, list[EnginePlacement]] = {}
        for p in plan.engines_of(router.model_name):
            by_engine.setdefault(p.engine_index, []).append(p)
        for _, ps in sorted(by_engine.items()):
            engines.append(record_of(ps, settings, router.update_weights))
    model = plan.updatable_model
    for i, addr in enumerate(settings.external_addrs):
        engines.append(ManagedEngine(f"{model}/external/e{i}", model, [], True,
                                     external_address=addr))
    return engines
