"""One way back for an engine: a death starts `start_recovery(engine, reason)`, whoever saw it.

The exit watcher, the health monitor, a failed weight update and a failed memory release
all call `start_recovery`. It takes the engine out of its router at once (DEAD), then, in
one thread per engine: kill what is left, relaunch it on its own bundle (or wait for an
external engine's owner to bring it back), resync it through the fleet's weight source,
and route it. The healthy engines keep serving throughout. A death of the relaunched
server before its recovery ends starts the recovery over (at most MAX_RECOVERY_ATTEMPTS).

A STALE engine that no recovery owns (a failed sync, a router restart, probes that pass
again after the version moved on) gets a resync of its own (`resync_stale_later`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from slime_like.errors import FleetError, WeightSyncError
from slime_like.fleet.events import EngineState, Happening
from slime_like.fleet.lifecycle import GONE, ManagedEngine

if TYPE_CHECKING:
    from slime_like.fleet.fleet import Fleet

logger = logging.getLogger(__name__)

# A recovery whose relaunched server dies too starts over, this many times at most.
MAX_RECOVERY_ATTEMPTS = 5
S = EngineState


class Recovery:
    """Recoveries and resyncs of one fleet, and the record of each recovery."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.recoveries: list[dict] = []

    # ---- a death -----------------------------------------------------------------------------

    def start_recovery(self, e: ManagedEngine, reason: str) -> None:
        """The engine is dead: out of its router now, and back in its own thread."""
        fleet = self.fleet
        with fleet.lock:
            if fleet.closing:
                return
            if e.recovering:
                # Relaunched (or back), then dead again before its recovery ended: the
                # recovery sees DEAD, stops resyncing and starts over (or, if it had just
                # finished, a new one starts).
                if e.state not in GONE:
                    e.died_while_recovering = reason
                    self._mark_dead(e, reason)
                return
            if e.state in GONE:
                return  # a recovery already gave up on it, or it is stopping
            e.recovering = True
            self._mark_dead(e, reason)
        self._spawn(e, reason)

    def _mark_dead(self, e: ManagedEngine, reason: str) -> None:
        self.fleet.unroute(e)  # before anything else: no request may reach a dead engine
        self.fleet.move(e, S.DEAD, reason=reason)
        self.fleet.health.unwatch(e)

    def _spawn(self, e: ManagedEngine, reason: str) -> None:
        threading.Thread(target=self._recover, args=(e, reason), name=f"recover-{e.engine_id}",
                         daemon=True).start()

    def _recover(self, e: ManagedEngine, reason: str) -> None:
        fleet = self.fleet
        t0 = time.time()
        try:
            for attempt in range(1, MAX_RECOVERY_ATTEMPTS + 1):
                try:
                    if not self._bring_back(e):
                        return  # the fleet is shutting down
                    break
                except Exception as err:
                    with fleet.lock:
                        again, e.died_while_recovering = e.died_while_recovering, None
                    if again is None or fleet.closing or attempt == MAX_RECOVERY_ATTEMPTS:
                        raise
                    logger.warning("%s died again before its recovery finished (%s); "
                                   "recovering it again (attempt %d of %d): %s", e.engine_id,
                                   again, attempt + 1, MAX_RECOVERY_ATTEMPTS, err)
            took = time.time() - t0
            self.recoveries.append({"engine": e.engine_id, "reason": reason,
                                    "recovery_s": round(took, 2), "version": str(fleet.version),
                                    "url": e.url, "dead_at": e.dead_at})
            fleet.events.emit(e.engine_id, Happening.RECOVERED, recovery_s=round(took, 2))
            logger.warning("%s recovered in %.1fs at version %s (%s)", e.engine_id, took,
                           fleet.version, e.url)
        except Exception as err:  # noqa: BLE001 - report it; the run goes on with fewer engines
            logger.exception("%s: recovery failed", e.engine_id)
            self.recoveries.append({"engine": e.engine_id, "reason": reason,
                                    "error": f"{type(err).__name__}: {err}"})
            with fleet.lock:
                if e.state not in (S.DEAD, S.STOPPED):
                    fleet.unroute(e)
                    fleet.move(e, S.DEAD, reason=f"recovery failed: {err}")
        finally:
            with fleet.lock:
                again, e.died_while_recovering = e.died_while_recovering, None
                if again is None or fleet.closing:
                    e.recovering = False
            if again is not None and not fleet.closing:  # died just as it was routed again
                self._spawn(e, again)

    def _bring_back(self, e: ManagedEngine) -> bool:
        """Relaunch (or reattach) a dead engine and bring it to the fleet's version; False if
        the fleet is shutting down."""
        back = self._reattach(e) if e.external_address is not None else self._relaunch(e)
        if not back:
            return False
        self.fleet.health.watch(e)
        if not e.update_weights:
            with self.fleet.lock:
                self.fleet.route_frozen(e)
        else:
            self.resync(e)
        return True

    def _relaunch(self, e: ManagedEngine) -> bool:
        """Our engine: kill what is left of it, start it again on its bundle (STALE)."""
        fleet, launcher = self.fleet, self.fleet.launcher
        launcher.kill(e)
        with fleet.lock:
            if fleet.closing:
                return False
            fleet.move(e, S.RELAUNCHING)
        e.restarts += 1
        launcher.wait_launched(launcher.launch(e))
        with fleet.lock:
            fleet.move(e, S.STALE, **launcher.loaded(e))
        fleet.health.watch_exit(e)
        return True

    def _reattach(self, e: ManagedEngine) -> bool:
        """An external engine: wait (bounded) for its owner to bring it back, then STALE."""
        fleet, wait_s = self.fleet, self.fleet.settings.external_wait_s
        with fleet.lock:
            if fleet.closing:
                return False
            fleet.move(e, S.REATTACHING, address=e.external_address, wait_s=wait_s)
        loaded = fleet.launcher.reattach(e, wait_s)
        if loaded is None:
            return False
        e.restarts += 1
        with fleet.lock:
            fleet.move(e, S.STALE, **loaded)
        return True

    # ---- resyncs -----------------------------------------------------------------------------

    def resync(self, e: ManagedEngine, timeout: float = 600.0) -> None:
        """Bring a STALE engine to the fleet's version and route it (or let a full sync do it)."""
        fleet = self.fleet
        if fleet.weight_source is None:
            raise FleetError(f"{e.engine_id}: no weight source to resync it (set_weight_source)")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not fleet.closing:
            if e.state is S.REGISTERED:
                return  # a full sync took it along
            if e.state in GONE:
                raise FleetError(f"{e.engine_id}: {e.state.value} while waiting to resync")
            if e.state is not S.STALE or fleet.syncing:
                time.sleep(0.05)
                continue
            try:
                with fleet.updating([e.engine_id]) as update:
                    update.report = fleet.weight_source(update) or {}
            except (WeightSyncError, FleetError) as err:
                logger.warning("%s: resync failed (%s); retrying", e.engine_id, err)
                time.sleep(0.5)
                continue
            if e.state is not S.REGISTERED:
                time.sleep(0.5)  # e.g. the router is being relaunched
        if e.state is not S.REGISTERED:
            if fleet.closing:
                raise FleetError(f"{e.engine_id}: the fleet closed before it was resynced")
            raise FleetError(f"{e.engine_id}: not at version {fleet.version} after {timeout:.0f}s")

    def resync_stale_later(self) -> None:
        """STALE engines not already being recovered get their own resync thread."""
        fleet = self.fleet
        if fleet.weight_source is None or fleet.closing:
            return
        with fleet.lock:
            stale = [e for e in fleet.engines if e.state is S.STALE and e.update_weights
                     and not (e.recovering or e.resyncing or e.awaiting_full_sync)]
            for e in stale:
                e.resyncing = True
        for e in stale:
            threading.Thread(target=self._resync_then_release, args=(e,),
                             name=f"resync-{e.engine_id}", daemon=True).start()

    def _resync_then_release(self, e: ManagedEngine) -> None:
        try:
            self.resync(e)
        except Exception as err:  # noqa: BLE001 - stays STALE; the next full sync takes it along
            logger.warning("%s: resync stopped: %s", e.engine_id, err)
        finally:
            with self.fleet.lock:
                e.resyncing = False

    def wait_idle(self, timeout: float = 300.0) -> bool:
        """Block until no recovery or resync is running (True) or the timeout passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.fleet.lock:
                if not any(e.recovering or e.resyncing for e in self.fleet.engines):
                    return True
            time.sleep(0.1)
        return False
