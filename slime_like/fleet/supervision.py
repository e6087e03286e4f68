"""The fleet's supervision: every engine's record and moves, its router, its health and
its way back, colocated memory release, the views and the shutdown.

`Supervision` keeps the lock and the records; `move` is the one place an engine changes
phase. The parts advise and the supervision applies their advice under the lock: a health
`Verdict` (suspect, healthy again, dead) becomes a move; a death, or an engine a sync
found hung, becomes a `Tending` (tending.py, the `Tendings` this class is), one thread per
engine that asks the recovery for its next `Step` (relaunch, reattach, probe, resync,
route, wait) and does it, until the engine is back or given up (LOST); a resumed colocated
engine goes where `Offload.after_resume` says. `Fleet` (fleet.py) adds the update
transaction, through which every resync runs too, and generation through the routers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self

from slime_like.cluster.placement import JobPlacement
from slime_like.config.fleet_slices import FleetSettings
from slime_like.engine.fanout import each
from slime_like.engine.session import EngineSession
from slime_like.errors import FleetError
from slime_like.fleet.attempts import WeightSource
from slime_like.fleet.events import EngineState, EventBus, EventSink, Happening
from slime_like.fleet.generation import Generation
from slime_like.fleet.health import Finding, FleetHealth, Verdict
from slime_like.fleet.launcher import Launcher
from slime_like.fleet.lifecycle import ROUTED, ManagedEngine, Phase, records_from_plan
from slime_like.fleet.nodes import NodeLoss
from slime_like.fleet.offload import Offload
from slime_like.fleet.recovery import Recovery, Tending
from slime_like.fleet.routers import Routers
from slime_like.fleet.tending import Tendings
from slime_like.protocol.weight_version import WeightVersion

logger = logging.getLogger(__name__)

P = Phase
# Re-adding an engine to a relaunched router: one that served a moment ago registers in
# well under a second; one that takes longer is hung and resyncs instead.
REROUTE_TIMEOUT_S = 10.0


class Supervision(Tendings):
    """Engines of every model in the job: their records, moves, routers, health and
    recovery; `Fleet` adds the update transaction and generation."""

    def __init__(self, settings: FleetSettings, placement: JobPlacement,
                 on_event: EventSink | None = None):
        self.settings = settings
        self.placement = placement
        self.log_dir = Path(settings.log_dir)
        self.events = EventBus(on_event)
        self.version = WeightVersion(0)
        self.weight_source: WeightSource | None = None
        self.lock = threading.RLock()
        self.closing = False
        self._full_update = threading.Event()  # a full update is open
        self._syncing = threading.Event()      # a full sync with its retries is running
        self._on_shutdown: list[Callable[[], None]] = []
        self._tending: dict[str, Tending] = {}  # engines being brought back, by id
        self.engines = records_from_plan(placement.plan, settings)
        self.launcher = Launcher(settings, placement, self.log_dir)
        self.routers = Routers(settings, list(placement.plan.routers), self.updatable_model,
                               self.log_dir, self.events)
        self.routers.on_restarted = self._reroute
        self.generation = Generation(settings, self.routers, self.engines, self.updatable_model)
        self.recovery = Recovery()
        self.health = FleetHealth(settings.health, self.launcher, self.engines, self._heard)
        self.offload = Offload(settings)
        self.nodes = NodeLoss(placement, self.events)

    # ---- events and moves ------------------------------------------------------------------

    def subscribe(self, sink: EventSink) -> None:
        """Call `sink(event)` with every `FleetEvent` (engine and router states, happenings)."""
        self.events.subscribe(sink)

    def move(self, e: ManagedEngine, dst: Phase, happening: Happening | None = None,
             seen_at: float | None = None, **details: Any) -> None:
        """The one place engines change phase (the table in lifecycle.py is enforced).

        Entering a routed phase adds the engine to its router first (refused unless it
        serves the fleet's version: then nothing moves); leaving one takes it out first, so
        no request reaches an engine that is no longer REGISTERED. A change of state is an
        event; a change of phase alone is `happening`, if given. `seen_at`: when what
        caused the move was found (a death); the event says how long after it came
        (`after_seen_ms`: the router's removal and the lock's wait).
        """
        e.check(dst)
        if dst in ROUTED and not e.routed:
            self._route(e)
        elif e.routed and dst not in ROUTED:
            self.routers.remove(e)
        src = e.move(dst)
        if seen_at is not None:
            details["after_seen_ms"] = round((time.time() - seen_at) * 1e3, 1)
        if src.state is not dst.state:
            self.events.emit(e.engine_id, dst.state, src.state, **details)
        elif happening is not None:
            self.events.emit(e.engine_id, happening, **details)

    def find(self, engine_id: str) -> ManagedEngine:
        """The engine of that id (KeyError if none)."""
        return {e.engine_id: e for e in self.engines}[engine_id]

    # ---- routing ----------------------------------------------------------------------------

    def router_url(self, model: str | None = None) -> str:
        """The URL to generate through for `model` (default: the updatable model)."""
        return self.routers.url(model or self.updatable_model)

    @property
    def updatable_model(self) -> str:
        return self.placement.plan.updatable_model

    @property
    def reference_model(self) -> str | None:
        """The first frozen model (update_weights: false), the KL term's reference."""
        return next((r.model_name for r in self.placement.plan.routers
                     if not r.update_weights), None)

    def _route(self, e: ManagedEngine, timeout: float | None = None, *,
               if_answering: bool = False) -> None:
        """Add an engine to its router; refused unless it serves the fleet's version."""
        if e.update_weights and e.verified_version != self.version:
            raise FleetError(f"engine {e.engine_id} serves version {e.verified_version}, the "
                             f"fleet is at {self.version}: not routed")
        self.routers.add(e, timeout, if_answering=if_answering)

    def _reroute(self, model: str) -> tuple[int, int]:
        """After a router's relaunch: its engines re-added (or resync) at once, each within
        REROUTE_TIMEOUT_S (a hung one would hide behind the lock from the health monitor),
        if they answer /health now. Not those in a sync (paused: no /health answer); its
        settle routes them. The router cannot cancel a registration it still probes.
        Returns (engines re-added now, engines left to their sync's settle)."""
        with self.lock:
            mine = [e for e in self.engines if e.model_name == model and e.routed]
            in_sync = 0
            for e in mine:
                self.routers.forget(e)
                if e.phase is P.UPDATING_ROUTED:
                    self.move(e, P.UPDATING)  # out with the old router; its sync routes it
                    in_sync += 1
            serving = [e for e in mine if e.phase is P.REGISTERED]
            outcomes = each(serving, lambda e: self._route(e, REROUTE_TIMEOUT_S,
                                                           if_answering=True))
            for e, (_, err) in zip(serving, outcomes, strict=True):
                if err is not None:  # it resyncs or recovers instead
                    logger.warning("%s: not re-added to the new router: %s", e.engine_id, err)
                    self.move(e, P.STALE, reason=f"router restart: {err}")
        self._tend_stale()
        return len(serving), in_sync

    # ---- start ------------------------------------------------------------------------------

    def start(self) -> Self:
        """Routers, then every engine concurrently. Frozen models' engines are routed at once;
        the updatable model's wait (LOADED) for the first sync."""
        self.routers.start()
        refs = {}
        for e in self.engines:
            self.events.emit(e.engine_id, EngineState.LAUNCHING,
                             **({"node": e.placements[0].node_ip} if e.placements else {}))
            if e.external_address is None:
                refs[e.engine_id] = self.launcher.launch(e)
        for e in self.engines:
            if e.external_address is not None:
                with self.lock:
                    self.move(e, P.LOADED, **self.launcher.attach(e))
                continue
            self.launcher.wait_launched(refs[e.engine_id])
            with self.lock:
                self.move(e, P.LOADED, **self.launcher.loaded(e))
                if not e.update_weights:  # frozen: it serves its checkpoint as loaded
                    e.verified_version = None
                    self._route_frozen(e, version="frozen")
            self.health.watch_exit(e)
        self.health.start()
        return self

    def _route_frozen(self, e: ManagedEngine, **details: Any) -> None:
        """A frozen model's engine serves its checkpoint: routed without a sync."""
        self.move(e, P.UPDATING, reason="frozen model: serves its checkpoint")
        self.move(e, P.REGISTERED, **details)

    # ---- weight updates (the transaction is `Fleet`'s) ------------------------------------

    @property
    def update_in_progress(self) -> bool:
        """A full update is open: engines may already serve its version."""
        return self._full_update.is_set()

    @property
    def syncing(self) -> bool:
        """A full update is open or about to be retried (resyncs wait for it)."""
        return self._full_update.is_set() or self._syncing.is_set()

    # ---- what the parts advise --------------------------------------------------------------

    def _heard(self, verdict: Verdict) -> None:
        """A finding of the health part, applied under the lock."""
        e, why = verdict.engine, verdict.reason
        if verdict.finding is Finding.DEAD:
            self.start_recovery(e, why, seen_at=verdict.seen_at)
            return
        with self.lock:
            if verdict.finding is Finding.SUSPECT:
                # First failed probe: out of the router at once (recovered or dead later).
                # One paused for an update leaves it too; the update's end routes it again
                # only if it verified.
                if e.phase is P.REGISTERED:
                    self.move(e, P.SUSPECT, reason=why)
                elif e.phase is P.UPDATING_ROUTED:
                    self.move(e, P.UPDATING, Happening.UNROUTED, reason=why)
                else:
                    return
            elif e.phase is not P.SUSPECT:
                return
            elif not e.update_weights or e.verified_version == self.version:
                self.move(e, P.REGISTERED, reason="probes pass again")
            else:
                self.move(e, P.STALE, reason="probes pass again, version moved on")
        if verdict.finding is Finding.SUSPECT:
            self.generation.resubmit_in_flight()  # stuck requests go again; first answer wins
        else:
            self._tend_stale()

    # ---- colocated engines ------------------------------------------------------------------

    @contextlib.contextmanager
    def offloaded(self, tags: Sequence[str] | None = None, *,
                  hold_for_sync: bool = False) -> Iterator[list[str]]:
        """Colocated engines release their memory for the body (see `fleet/offload.py`);
        the ids of those that did."""
        tag_list = list(tags) if tags else None
        with self.lock:
            chosen = [e for e in self.engines if e.phase is P.REGISTERED
                      and self.offload.applies_to(e) and e.handle is not None]
            for e in chosen:
                self.move(e, P.OFFLOADED, tags=tag_list or "all")
        released = self.offload.release(chosen, tag_list)
        try:
            yield [e.engine_id for e in released]
        finally:
            resumed = self.offload.resume(released)
            with self.lock:
                for e in [e for e in chosen if e.phase is P.OFFLOADED]:  # else: recovering
                    if e not in resumed:
                        self.start_recovery(e, "memory could not be released or resumed")
                        continue
                    current = not e.update_weights or e.verified_version == self.version
                    phase, why = self.offload.after_resume(e, current=current,
                                                           hold_for_sync=hold_for_sync)
                    self.move(e, phase, reason=why)

    # ---- views ------------------------------------------------------------------------------

    def states(self) -> dict[str, str]:
        with self.lock:
            return {e.engine_id: e.state.value for e in self.engines}

    def handles(self, model: str | None = None) -> list[EngineSession]:
        """Handles of the engines serving now (REGISTERED), for callers of their own."""
        with self.lock:
            return [e.handle for e in self.engines if e.phase is P.REGISTERED and e.handle
                    and (model is None or e.model_name == model)]

    def metrics_urls(self) -> dict[str, str]:
        """Every engine's and router's Prometheus address (for the report and the console)."""
        out = {f"router/{m}": r.prometheus_url for m, r in self.routers.items()}
        out.update({e.engine_id: e.handle.url + "/metrics" for e in self.engines if e.handle})
        return out

    @property
    def recoveries(self) -> list[dict]:
        """Every recovery so far: engine, reason, seconds (or the error that ended it)."""
        return self.recovery.recoveries

    @property
    def router_restarts(self) -> list[dict]:
        return self.routers.restarts

    # ---- teardown ---------------------------------------------------------------------------

    def on_shutdown(self, fn: Callable[[], None]) -> None:
        """Run `fn` after the engines and routers are stopped (e.g. release the placement)."""
        self._on_shutdown.append(fn)

    def shutdown(self, reason: str | None = None) -> None:
        """Stop every engine (STOPPED) and router; then the on_shutdown calls.

        `reason` (e.g. the error that ended the job) goes on every STOPPED event; an engine
        still launching says so: it was stopped before it ever served.
        """
        with self.lock:
            self.closing = True
        self.launcher.close()
        self.routers.closing = True
        self.health.stop()
        with self.lock:
            for e in list(self.engines):
                if e.phase is P.LAUNCHING:
                    self.move(e, P.STOPPED, reason=f"{reason or 'the fleet shut down'} while "
                                                   "it was launching: it never served")
                elif e.phase is not P.STOPPED:
                    self.move(e, P.STOPPED, **({"reason": reason} if reason else {}))
        self.launcher.shutdown(self.engines)
        self.routers.stop()
        for fn in self._on_shutdown:
            fn()
        self._on_shutdown.clear()
