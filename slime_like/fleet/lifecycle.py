"""The engine lifecycle: the legal moves between states, and one engine's whole record.

    LAUNCHING -> LOADED -> UPDATING -> REGISTERED <-> UPDATING
    REGISTERED -> SUSPECT (a failed probe: out of the router) -> REGISTERED | DEAD
    UPDATING -> STALE (a sync that did not verify it: out of the router) -> UPDATING
    any -> DEAD -> RELAUNCHING -> STALE -> UPDATING -> REGISTERED
    REGISTERED -> OFFLOADED (memory released for a colocated train step: out of the router)
        -> REGISTERED (resumed, version still current) | STALE (resumed, version moved on)
    DEAD -> REATTACHING (an external engine: we wait for its owner to bring it back) -> STALE
    any -> STOPPED (shutdown)

Invariant: an engine is in its router only while its verified weight version equals the
fleet's current version (see docs/ARCHITECTURE.md). Only the fleet moves engines; `move`
refuses anything not in `TRANSITIONS`, so an illegal move is a bug that shows at once.
Everything the fleet knows about an engine is on its `ManagedEngine`: the state, where it
is routed, whether a recovery or resync of it is running, what it waits for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from slime_like.config.layout import EnginePlacement, JobPlan
from slime_like.config.slices import FleetSettings
from slime_like.engine.from_placement import engine_config
from slime_like.engine.session import EngineSession
from slime_like.errors import SlimeLikeError
from slime_like.fleet.events import EngineState
from slime_like.protocol.weight_version import WeightVersion

S = EngineState
TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    S.LAUNCHING: frozenset({S.LOADED, S.DEAD, S.STOPPED}),
    S.LOADED: frozenset({S.UPDATING, S.DEAD, S.STOPPED}),
    S.UPDATING: frozenset({S.REGISTERED, S.STALE, S.DEAD, S.STOPPED}),
    S.REGISTERED: frozenset({S.UPDATING, S.SUSPECT, S.STALE, S.OFFLOADED, S.DEAD, S.STOPPED}),
    S.SUSPECT: frozenset({S.REGISTERED, S.STALE, S.DEAD, S.STOPPED}),
    S.STALE: frozenset({S.UPDATING, S.DEAD, S.STOPPED}),
    S.DEAD: frozenset({S.RELAUNCHING, S.REATTACHING, S.STOPPED}),
    S.RELAUNCHING: frozenset({S.STALE, S.DEAD, S.STOPPED}),
    S.REATTACHING: frozenset({S.STALE, S.DEAD, S.STOPPED}),
    S.OFFLOADED: frozenset({S.REGISTERED, S.STALE, S.DEAD, S.STOPPED}),
    S.STOPPED: frozenset(),
}

# States an update may take an engine from (it then moves to UPDATING).
SYNCABLE: frozenset[EngineState] = frozenset({S.LOADED, S.REGISTERED, S.STALE})
# Dead, or on its way back: a recovery owns it.
GONE: frozenset[EngineState] = frozenset({S.DEAD, S.STOPPED, S.RELAUNCHING, S.REATTACHING})
# Probed by the health monitor (a STOPPED or dead engine is not).
WATCHED: frozenset[EngineState] = frozenset({S.REGISTERED, S.SUSPECT, S.LOADED, S.STALE,
                                             S.UPDATING, S.OFFLOADED})


class IllegalTransition(SlimeLikeError):
    """A move the lifecycle table does not allow (a bug in the caller)."""

    def __init__(self, engine_id: str, src: EngineState, dst: EngineState):
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
    state: EngineState = EngineState.LAUNCHING
    verified_version: WeightVersion | None = None
    routed: bool = False
    router_worker_id: str | None = None
    restarts: int = 0  # launches after the first: an exit of an older server is not news
    dead_at: float | None = None
    # Why the server its recovery started died too, before that recovery finished.
    died_while_recovering: str | None = None
    recovering: bool = False          # a recovery thread owns it
    resyncing: bool = False           # a resync thread of its own runs (it was STALE)
    awaiting_full_sync: bool = False  # released without a weight backup: the next full sync
    # Resumed and held out of the router, nothing running, for the sync that follows: that
    # sync needs no pause or continue for it (`Fleet.Update.quiet`).
    held_for_sync: bool = False

    @property
    def url(self) -> str | None:
        return self.handle.url if self.handle else None

    @property
    def colocated(self) -> bool:
        """On the trainer's GPUs: it gives its memory back around each train step."""
        return (self.external_address is None and bool(self.placements)
                and self.placements[0].shares_trainer_gpus)

    def move(self, dst: EngineState) -> EngineState:
        """Change state if the table allows it; the previous state."""
        src = self.state
        if dst not in TRANSITIONS[src]:
            raise IllegalTransition(self.engine_id, src, dst)
        self.state = dst
        if dst is not EngineState.STALE:
            self.held_for_sync = False  # anything but waiting for that sync ends the hold
        if dst is EngineState.DEAD:
            self.dead_at = time.time()
        return src


def records_from_plan(plan: JobPlan, settings: FleetSettings) -> list[ManagedEngine]:
    """One record per engine of the plan (all its node placements), then the external ones."""
    engines: list[ManagedEngine] = []
    for router in plan.routers:
        by_engine: dict[int, list[EnginePlacement]] = {}
        for p in plan.engines_of(router.model_name):
            by_engine.setdefault(p.engine_index, []).append(p)
        for _, ps in sorted(by_engine.items()):
            ps.sort(key=lambda p: p.node_rank)
            path = settings.model_paths.get(ps[0].model_name) or ps[0].model_path or ""
            cfg = engine_config(ps[0], settings.engine, model_path=path)
            engines.append(ManagedEngine(
                ps[0].engine_id, router.model_name, ps, router.update_weights,
                tp_size=max(1, ps[0].num_gpus // cfg.pp_size)))
    model = plan.updatable_model
    for i, addr in enumerate(settings.external_addrs):
        engines.append(ManagedEngine(f"{model}/external/e{i}", model, [], True,
                                     external_address=addr))
    return engines
