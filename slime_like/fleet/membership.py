"""Elastic membership: engines added to a running fleet, and engines drained out of it.

    fleet.add_engines(2)                    # launched while the others serve; routed once
                                            # verified at the fleet's version
    fleet.drain(["policy/g0/e3"], deadline_s=30)   # unrouted; running requests finish or
                                            # are moved; stops at the next regroup
    fleet.resize(8)                         # either, to reach 8 engines of the model

An added engine is a record like the launch's, on bundles `Capacity` finds (a free bundle
of the job's placement groups, or a group of its own wherever the cluster has room). It
goes LAUNCHING -> LOADED, then, if the fleet already serves a version, STALE: the fleet's
own resync (the path a replaced engine takes, `recovery.py`) gives it the current weights
from the weight source over a group of its own, without pausing anyone, and the update's
settle routes it only if it verified at the fleet's version. A full sync that starts
meanwhile takes it along instead.

A drain moves each engine to DRAINING (out of its router first, never probed, synced or
recovered again), waits for its running requests up to the deadline and aborts the rest,
which their clients send again through the router (`draining.py`); then DRAINED. An engine
that took part in the last full update is still a member of the trainer's weight group:
it stops after the next successful full update, which rebuilt the group without it and
asked it to leave the old one (`weights/distributed.py`, the regroup). The others stop at
once. A stopped engine's bundles are free for the next added engine; a group of its own
goes back to the cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from slime_like.cluster.capacity import Capacity
from slime_like.cluster.placement import JobPlacement
from slime_like.config.fleet_slices import FleetSettings
from slime_like.config.layout import EnginePlacement
from slime_like.engine.fanout import each
from slime_like.errors import FleetError
from slime_like.fleet.attempts import Update
from slime_like.fleet.draining import Drained, DrainReport, drain_requests
from slime_like.fleet.events import EngineState, EventSink, Happening
from slime_like.fleet.lifecycle import DRAINABLE, LEAVING, ManagedEngine, Phase, record_of
from slime_like.fleet.supervision import Supervision

logger = logging.getLogger(__name__)

P = Phase
# A drain waits this long at most for an engine in a weight update to leave it.
UPDATE_WAIT_S = 120.0
_OUT = LEAVING | {P.STOPPED, P.LOST}


class Membership(Supervision):
    """The fleet's engines coming and going while it runs (`Fleet` is one)."""

    def __init__(self, settings: FleetSettings, placement: JobPlacement,
                 on_event: EventSink | None = None):
        super().__init__(settings, placement, on_event)
        self.capacity = Capacity(placement)
        self.served = False               # a full update has landed: engines join STALE
        self.retired: list[ManagedEngine] = []  # engines that left (drained), in order
        self._grouped: set[str] = set()   # in the weight group of the last full update(s)
        self._join_errors: dict[str, str] = {}
        self._last_index = {r.model_name: max((p.engine_index for p in
                                               placement.plan.engines_of(r.model_name)),
                                              default=-1)
                            for r in placement.plan.routers}

    # ---- adding --------------------------------------------------------------------------------

    def add_engines(self, n: int, *, model: str | None = None, like: str | None = None,
                    wait: bool = True, timeout_s: float = 600.0) -> list[str]:
        """Launch `n` more engines of `model` (default: the updatable one), each like engine
        `like` (default: the model's first engine of the launch); their ids.

        With `wait`, returns once each serves: routed after its resync verified it at the
        fleet's version (LOADED if the fleet has served no version yet); FleetError naming
        the engine if one cannot be placed, launched or synced within `timeout_s`.
        """
        if n < 1:
            raise FleetError(f"add_engines: n must be at least 1, got {n}")
        with self.lock:
            if self.closing:
                raise FleetError("the fleet is shutting down: no engine is added")
            template = self._template(model, like)
            model = template.model_name
            indices = [self._last_index[model] + 1 + k for k in range(n)]
            self._last_index[model] += n
        t0 = time.monotonic()
        placements: list[EnginePlacement] = []
        try:
            for index in indices:
                placements.append(self.capacity.take(template, index, timeout_s))
        except BaseException:
            for p in placements:
                self.capacity.release(p.engine_id)
            raise
        added = [record_of([p], self.settings, template.update_weights) for p in placements]
        with self.lock:
            if self.closing:  # it shut down while the placement waited for room
                for p in placements:
                    self.capacity.release(p.engine_id)
                raise FleetError("the fleet is shutting down: no engine is added")
            for e, p in zip(added, placements, strict=True):
                self.engines.append(e)
                self.health.admit(e)
                self.events.emit(e.engine_id, EngineState.LAUNCHING, added=True,
                                 node=p.node_ip, placement_group=p.placement_group)
        for e in added:
            threading.Thread(target=self._join, args=(e,), name=f"join-{e.engine_id}",
                             daemon=True).start()
        ids = [e.engine_id for e in added]
        if wait:
            self._wait_joined(added, t0 + timeout_s)
        return ids

    def _template(self, model: str | None, like: str | None) -> EnginePlacement:
        """The placement an added engine copies: engine `like`'s, or the model's first."""
        if like is not None:
            mine = [e for e in self.engines + self.retired if e.engine_id == like]
            if not mine or not mine[0].placements:
                raise FleetError(f"add_engines: no engine of ours is called {like!r} "
                                 f"(engines: {[e.engine_id for e in self.engines]})")
            if model is not None and mine[0].model_name != model:
                raise FleetError(f"add_engines: {like} serves {mine[0].model_name}, not {model}")
            return mine[0].placements[0]
        model = model or self.updatable_model
        plan = [p for p in self.placement.plan.engines_of(model) if p.node_rank == 0]
        if model not in self._last_index:
            raise FleetError(f"add_engines: no model {model!r} in this fleet "
                             f"(models: {sorted(self._last_index)})")
        if not plan:
            raise FleetError(f"add_engines: {model} has no engine of ours to copy (external "
                             "engines are attached by address, not added)")
        return plan[0]

    def _join(self, e: ManagedEngine) -> None:
        """Launch an added engine, and bring it to the fleet's version (its own thread)."""
        try:
            self.launcher.wait_launched(self.launcher.launch(e))
            with self.lock:
                gone = self.closing or e.phase is not P.LAUNCHING
                if not gone:
                    self.move(e, P.LOADED, **self.launcher.loaded(e))
                    if not e.update_weights:  # frozen: it serves its checkpoint as loaded
                        e.verified_version = None
                        self._route_frozen(e, version="frozen")
                    elif self.served:  # else the first full update takes it along
                        self.move(e, P.STALE, reason=f"added: resyncs to version {self.version}")
            if gone:  # the fleet shut down meanwhile, maybe before these actors existed
                self.launcher.shutdown([e])
                return
        except Exception as err:  # noqa: BLE001 - the engine is not added; the fleet goes on
            logger.exception("%s: could not be added", e.engine_id)
            self._join_errors[e.engine_id] = f"{type(err).__name__}: {err}"
            self._retire(e, f"not added: {type(err).__name__}: {err}")
            return
        self.health.watch_exit(e)
        self.health.watch(e)
        self._tend_stale()

    def _wait_joined(self, added: list[ManagedEngine], deadline: float) -> None:
        while True:
            with self.lock:
                failed = [e for e in added if e.phase in (P.STOPPED, P.LOST)]
                pending = [e for e in added if not (
                    e.phase is P.REGISTERED or (e.phase is P.LOADED and not self.served))]
            if failed:
                raise FleetError("not added: " + "; ".join(
                    f"{e.engine_id}: {self._join_errors.get(e.engine_id, e.state.value)}"
                    for e in failed))
            if not pending:
                return
            if time.monotonic() > deadline:
                raise FleetError("added engines not serving in time: " + ", ".join(
                    f"{e.engine_id} {e.state.value} ({e.url or 'not up'})" for e in pending))
            time.sleep(0.1)

    # ---- draining ------------------------------------------------------------------------------

    def drain(self, engine_ids: Sequence[str], *, deadline_s: float = 30.0,
              stop_now: bool = False) -> DrainReport:
        """Take engines out of the fleet without losing a request.

        Each leaves its router at once; its running requests finish, and those still
        running after `deadline_s` are aborted and sent again by their clients to the
        other engines. Returns when every engine is DRAINED. Engines in the last full
        update's weight group stop after the next full update (which regroups without
        them), the others now; `stop_now` stops them all now (a push without weight
        groups, e.g. disk or tensor, never regroups).
        """
        ids = list(dict.fromkeys(engine_ids))
        if not ids:
            raise FleetError("drain: no engine ids given")
        chosen = self._start_draining(ids, deadline_s)
        outcomes = each(chosen, lambda e: drain_requests(e.engine_id, e.handle, deadline_s))
        drained: list[Drained] = []
        later: list[str] = []
        for e, (done, err) in zip(chosen, outcomes, strict=True):
            d = done if err is None else Drained(e.engine_id, e.url or "", 0, 0, 0.0, False)
            drained.append(d)
            with self.lock:
                if e.phase is P.DRAINING:
                    self.move(e, P.DRAINED, Happening.DRAINED, running=d.running,
                              moved=d.moved, drain_s=round(d.seconds, 3))
                wait = (e.phase is P.DRAINED and not stop_now and not self.closing
                        and e.engine_id in self._grouped)
            if wait:
                later.append(e.engine_id)
            else:
                self._retire(e, "drained")
        return DrainReport(tuple(drained), tuple(later))

    def _start_draining(self, ids: list[str], deadline_s: float) -> list[ManagedEngine]:
        """Every engine of `ids` DRAINING (out of its router), once none is in an update."""
        until = time.monotonic() + UPDATE_WAIT_S
        while True:
            with self.lock:
                if self.closing:
                    raise FleetError("the fleet is shutting down: nothing to drain")
                by_id = {e.engine_id: e for e in self.engines}
                unknown = [i for i in ids if i not in by_id]
                if unknown:
                    raise FleetError(f"drain: no engine {unknown} in the fleet (engines: "
                                     f"{sorted(by_id)})")
                chosen = [by_id[i] for i in ids]
                external = [e for e in chosen if e.external_address is not None]
                if external:
                    raise FleetError("drain: external engines are attached, not ours to stop: "
                                     + ", ".join(f"{e.engine_id} ({e.external_address})"
                                                 for e in external))
                updating = [e for e in chosen if e.phase in (P.UPDATING, P.UPDATING_ROUTED)]
                bad = [e for e in chosen if e.phase not in DRAINABLE and e not in updating]
                if bad:
                    raise FleetError("drain: " + ", ".join(
                        f"{e.engine_id} ({e.url or 'no server'}) is {e.phase.value}"
                        for e in bad) + f"; an engine can be drained from "
                        f"{sorted(p.value for p in DRAINABLE)}")
                if not updating:
                    for e in chosen:
                        self.health.unwatch(e)
                        self.move(e, P.DRAINING, reason="drained", deadline_s=deadline_s)
                    return chosen
            if time.monotonic() > until:
                raise FleetError("drain: still in a weight update after "
                                 f"{UPDATE_WAIT_S:g}s: {[e.engine_id for e in updating]}")
            time.sleep(0.05)

    def start_recovery(self, e: ManagedEngine, reason: str, *,
                       seen_at: float | None = None) -> None:
        """A death; one of an engine leaving the fleet only hastens its stop (its clients
        resubmit what it ran)."""
        with self.lock:
            leaving = e.phase in LEAVING and not self.closing
        if not leaving:
            super().start_recovery(e, reason, seen_at=seen_at)
            return
        self.generation.resubmit_in_flight()
        threading.Thread(target=self._retire, args=(e, f"died while leaving: {reason}"),
                         name=f"retire-{e.engine_id}", daemon=True).start()

    def _bundles_moved(self, e: ManagedEngine) -> None:
        self.capacity.moved(e.placements)

    def _retire(self, e: ManagedEngine, reason: str) -> None:
        """STOPPED, its servers stopped, out of the fleet's records, its bundles free. At
        shutdown the fleet's own teardown stops it instead."""
        with self.lock:
            if self.closing or e not in self.engines:
                return
            if e.phase is not P.STOPPED:
                self.move(e, P.STOPPED, reason=reason)
            self.health.unwatch(e)
        self.launcher.shutdown([e])
        with self.lock:
            if e in self.engines:
                self.engines.remove(e)
                self.retired.append(e)
        self.capacity.release(e.engine_id)

    def _after_update(self, chosen: list[ManagedEngine], update: Update,
                      failed: BaseException | None) -> None:
        """After a full update: who is in the weight group now. A successful one regrouped
        without the drained engines (they left the old group), so they stop."""
        if not update.full:
            return
        ids = {e.engine_id for e in chosen}
        with self.lock:
            if failed is not None:
                self._grouped |= ids  # the attempt may have regrouped with them
                return
            self.served = True
            self._grouped = ids
            leaving = [e for e in self.engines if e.phase is P.DRAINED]
        for e in leaving:
            threading.Thread(target=self._retire, args=(e, "left the weight group at the "
                                                        f"regroup of version {update.version}"),
                             name=f"retire-{e.engine_id}", daemon=True).start()

    # ---- to a size -----------------------------------------------------------------------------

    def resize(self, engines: int, *, model: str | None = None, deadline_s: float = 30.0,
               timeout_s: float = 600.0) -> dict:
        """Add or drain engines of `model` (default: the updatable one) until it has
        `engines` (those leaving or given up not counted; external ones counted, never
        drained). Drains the newest first. What it did, as a dict."""
        model = model or self.updatable_model
        if engines < 1:
            raise FleetError(f"resize: a model needs at least one engine, asked {engines}")
        with self.lock:
            active = [e for e in self.engines if e.model_name == model and e.phase not in _OUT]
        out: dict = {"model": model, "before": len(active), "engines": engines,
                     "added": [], "drained": [], "moved": 0}
        if engines > len(active):
            out["added"] = self.add_engines(engines - len(active), model=model,
                                            timeout_s=timeout_s)
        elif engines < len(active):
            ours = sorted((e for e in active if e.external_address is None and e.placements),
                          key=lambda e: e.placements[0].engine_index, reverse=True)
            pick = ours[:len(active) - engines]
            if len(pick) < len(active) - engines:
                raise FleetError(f"resize: {model} has {len(ours)} engines of ours to drain, "
                                 f"{len(active) - engines} asked")
            report = self.drain([e.engine_id for e in pick], deadline_s=deadline_s)
            out.update(report.as_dict())
        return out
