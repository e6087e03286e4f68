"""The way back of every engine: each death or suspicion becomes a `Tending`.

`Tendings` is the part of the fleet's supervision that brings engines back (`Supervision`
is one): a death (`start_recovery`), an engine a weight sync found hung (`suspect`) or a
STALE engine nobody brings back yet (`_tend_stale`) gets one thread that asks
`Recovery.next_step` what the engine needs (recovery.py), does it under the fleet's lock
for its moves, and asks again until it is back, or given up (LOST).
"""

from __future__ import annotations

import logging
import threading
import time

from slime_like.config.fleet_slices import FleetSettings
from slime_like.fleet.attempts import WeightSource
from slime_like.fleet.events import EventBus, Happening
from slime_like.fleet.health import ACTOR_LOST, FleetHealth
from slime_like.fleet.launcher import Launcher
from slime_like.fleet.lifecycle import GONE, ManagedEngine, Phase
from slime_like.fleet.nodes import NodeLoss
from slime_like.fleet.recovery import Recovery, Step, Tending
from slime_like.protocol.weight_version import WeightVersion

logger = logging.getLogger(__name__)

P = Phase
_ENDS = (Step.RECOVERED, Step.GIVE_UP, Step.LEAVE)
# A hung engine's tending asks `/ping` this long (a fresh connection each time, so a host
# whose link came back is reached at once), about once a second, until it answers.
ANSWER_PROBE_S = 1.0


class Tendings:
    """Engines being brought back, one thread each. The supervision provides the records
    and the parts below, the lock, `move` (the one place phases change), `syncing` and
    `_route_frozen`; `Fleet` the resync of one engine (`_resync`)."""

    settings: FleetSettings
    lock: threading.RLock
    closing: bool
    engines: list[ManagedEngine]
    events: EventBus
    version: WeightVersion
    weight_source: WeightSource | None
    launcher: Launcher
    health: FleetHealth
    recovery: Recovery
    nodes: NodeLoss
    _tending: dict[str, Tending]

    def start_recovery(self, e: ManagedEngine, reason: str, *,
                       seen_at: float | None = None) -> None:
        """The engine is dead: out of its router and DEAD now, then brought back by a
        tending of its own (the one it has already, if it died while being brought back).
        `seen_at`: when the death was found (the DEAD event says how long before it)."""
        with self.lock:
            if self.closing or e.phase in GONE:
                return  # on its way back already, given up, or stopping
            self.move(e, P.DEAD, seen_at=seen_at, reason=reason)
            self.health.unwatch(e)
            if e.engine_id in self._tending:
                self._tending[e.engine_id].died(reason)
            else:
                self._tend(Tending(e, reason))

    def suspect(self, e: ManagedEngine, reason: str) -> None:
        """A weight sync found the engine hung: out of its router and SUSPECT now, its
        weights unverified (a call it missed may still land), not relaunched; its tending
        resyncs it once it answers, or relaunches it once the health monitor calls it dead
        (`recovery.py`)."""
        with self.lock:
            if self.closing or e.phase not in (P.UPDATING, P.UPDATING_ROUTED):
                return  # declared dead meanwhile, or stopping: its recovery owns it
            e.verified_version = None
            self.move(e, P.SUSPECT, reason=reason)
            answer_by = time.monotonic() + self.recovery.answer_wait_s(self.settings.health)
            t = self._tending.get(e.engine_id)
            if t is None:
                self._tend(Tending(e, answer_by=answer_by))
            else:  # a full sync took a STALE engine along
                t.answer_by = answer_by

    def _tend_stale(self) -> None:
        """STALE engines no tending owns get one that resyncs them."""
        if self.weight_source is None or self.closing:
            return
        with self.lock:
            for e in self.engines:
                if e.phase is P.STALE and e.update_weights and e.engine_id not in self._tending:
                    self._tend(Tending(e))

    def _tend(self, t: Tending) -> None:
        self._tending[t.engine.engine_id] = t
        threading.Thread(target=self._tend_until_done, args=(t,),
                         name=f"tend-{t.engine.engine_id}", daemon=True).start()

    def _tend_until_done(self, t: Tending) -> None:
        """Ask the recovery what the engine needs, do it, ask again, until it is back."""
        e = t.engine
        try:
            while True:
                with self.lock:
                    step = self.recovery.next_step(t, closing=self.closing,
                                                   syncing=self.syncing)
                    if step in _ENDS:
                        del self._tending[e.engine_id]
                        self._ended(t, step)
                        return
                self._do(t, step)
        except Exception as err:  # noqa: BLE001 - report it; the run goes on with fewer engines
            with self.lock:
                self._tending.pop(e.engine_id, None)
                if t.is_recovery and not self.closing:
                    logger.exception("%s: recovery failed", e.engine_id)
                    self._give_up(t, f"{type(err).__name__}: {err}")
                else:
                    logger.warning("%s: resync stopped: %s", e.engine_id, err)

    def _ended(self, t: Tending, step: Step) -> None:
        e = t.engine
        if step is Step.GIVE_UP:
            self._give_up(t, f"died {t.relaunches} times while it was brought back"
                          if e.phase is P.DEAD else f"not at version {self.version} in time")
        elif step is Step.RECOVERED and t.is_recovery:
            took = self.recovery.recovered(t, str(self.version))
            self.events.emit(e.engine_id, Happening.RECOVERED, recovery_s=took)
            logger.warning("%s recovered in %.1fs at version %s (%s)", e.engine_id, took,
                           self.version, e.url)

    def _give_up(self, t: Tending, error: str) -> None:
        """LOST: out of the router, watched no more; the run goes on with fewer engines."""
        e = t.engine
        self.recovery.failed(t, error)
        if e.phase not in (P.DEAD, P.LOST, P.STOPPED):
            self.move(e, P.DEAD, reason=f"recovery failed: {error}")
        if e.phase is P.DEAD:
            self.move(e, P.LOST, reason=error)
        self.health.unwatch(e)

    def _do(self, t: Tending, step: Step) -> None:
        """One step of bringing an engine back (outside the lock but for its moves)."""
        e, launcher = t.engine, self.launcher
        if step is Step.WAIT:
            time.sleep(0.05)
        elif step is Step.ROUTE_FROZEN:
            with self.lock:
                self._route_frozen(e)
        elif step is Step.RESYNC:
            self._resync(e)
        elif step is Step.PROBE:
            if not launcher.answers(e, timeout=ANSWER_PROBE_S):
                time.sleep(ANSWER_PROBE_S / 4)
                return
            with self.lock:
                if e.phase is P.SUSPECT:
                    self.move(e, P.STALE, reason="answers again after it hung in a weight sync")
        elif step is Step.CALL_DEAD:
            self.start_recovery(e, f"hung in a weight sync and no answer to /ping for "
                                   f"{self.recovery.answer_wait_s(self.settings.health):g}s")
        elif step is Step.RELAUNCH:
            launcher.kill(e)
            lost = self.nodes.lost_node(e)
            if lost is not None:
                with self.lock:
                    engines = list(self.engines)
                self.nodes.announce(lost, engines)
            with self.lock:
                if self.closing:
                    return
                self.move(e, P.RELAUNCHING)
            # Its actor died with no exit of its server: its node may be gone, its bundles
            # placed again elsewhere (Ray may say so only after the actor's death).
            if (lost is not None or (t.reason or "").startswith(ACTOR_LOST)) \
                    and not self._placed_again(e, lost):
                return  # the fleet is shutting down
            e.restarts += 1
            launched = launcher.wait_launched(launcher.launch(e), stop=lambda: self.closing)
            with self.lock:
                if self.closing or not launched:  # it stopped the actors it knew of
                    launcher.shutdown([e])
                    return
                self.move(e, P.STALE, **launcher.loaded(e))
            self.health.watch_exit(e)
            self.health.watch(e)
            t.back()
        elif step is Step.REATTACH:
            wait_s = self.settings.external_wait_s
            with self.lock:
                if self.closing:
                    return
                self.move(e, P.REATTACHING, address=e.external_address, wait_s=wait_s)
            loaded = launcher.reattach(e, wait_s)
            if loaded is None:
                return  # the fleet is shutting down
            e.restarts += 1
            with self.lock:
                self.move(e, P.STALE, **loaded)
            self.health.watch(e)
            t.back()

    def _placed_again(self, e: ManagedEngine, lost: str | None) -> bool:
        """Before a relaunch of an engine whose actor was lost: wait until Ray placed its
        bundles (again, if its node `lost` is gone: the fleet runs smaller meanwhile, and
        says so) and move its placements there; False if the fleet shuts down first."""
        placements = self.nodes.placed_again(e, lost, stop=lambda: self.closing,
                                             serving=self._serving_count)
        if placements is None:
            return False
        e.placements = placements
        self._bundles_moved(e)
        return True

    def _serving_count(self) -> tuple[int, int]:
        """(engines routed now, engines the fleet has that are not stopped)."""
        with self.lock:
            return (sum(e.routed for e in self.engines),
                    sum(e.phase is not P.STOPPED for e in self.engines))

    def _bundles_moved(self, e: ManagedEngine) -> None:
        """`e`'s bundles now lie where its placements say (`Membership` tracks them)."""

    def _resync(self, e: ManagedEngine) -> None:
        """One update of `e` alone at the fleet's version (`Fleet`, the update transaction)."""
        raise NotImplementedError

    def wait_recovered(self, timeout: float = 300.0) -> bool:
        """Block until no recovery or resync is running (True) or the timeout passes. An
        engine of a lost node that waits for room is not waited for: no wait brings it."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if not set(self._tending) - self.nodes.waiting:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
