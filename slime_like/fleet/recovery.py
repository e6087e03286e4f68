"""One way back for an engine, as advice: what a dead or STALE engine needs next.

Every death (the exit watcher, the health monitor, a failed weight update, a failed memory
release) reaches `Fleet.start_recovery(engine, reason)`: out of the router and DEAD at
once, then one thread per engine (`Tending`) asks `Recovery.next_step` what to do, the
fleet does it and moves the engine, and asks again: relaunch it on its own bundle (or wait
for an external engine's owner to bring it back), resync it through the fleet's weight
source, route it; give up (LOST) when it keeps dying or cannot be brought to the fleet's
version. The advice reads only the engine's phase and the tending's own record, so a death
of the relaunched server before its recovery ends is just DEAD again: the same recovery
relaunches it (at most MAX_RECOVERY_ATTEMPTS times). A STALE engine no recovery owns (a
failed sync, a router restart, probes that pass again after the version moved on) gets a
tending of its own that only resyncs it. The healthy engines keep serving throughout.

An engine a weight sync found hung (`Fleet.suspect`) is not dead yet: a SIGSTOP that is
continued, a host cut off for less than the health budget, or a deadline too low for a
loaded machine all look the same to the sync. It is SUSPECT (out of the router, its
weights unknown) and its tending probes it (`/ping`) until it answers (STALE: resynced in
place, the same server) or the health monitor declares it dead (relaunched, as any death).
With no verdict by `Tending.answer_by` (the monitor is off, or never decided) the tending
calls it dead itself.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from slime_like.config.fleet_slices import HealthSettings
from slime_like.fleet.launcher import LIVENESS_TIMEOUT_S
from slime_like.fleet.lifecycle import FOR_FULL_SYNC, ManagedEngine, Phase

# A recovery whose relaunched server dies too starts over, this many times at most.
MAX_RECOVERY_ATTEMPTS = 5
# How long an engine may stay STALE while it is tended before its tending gives up.
RESYNC_TIMEOUT_S = 600.0
P = Phase


class Step(enum.Enum):
    """What a tended engine needs next (the fleet does it)."""

    RELAUNCH = "relaunch"          # ours: kill what is left, start it on its bundle (STALE)
    REATTACH = "reattach"          # external: wait for its owner to bring it back (STALE)
    RESYNC = "resync"              # an update of it alone at the fleet's version
    PROBE = "probe"                # hung in a sync (SUSPECT): does it answer /ping yet?
    CALL_DEAD = "call dead"        # hung, no answer and no verdict in time: dead after all
    ROUTE_FROZEN = "route frozen"  # a frozen model's engine serves its checkpoint as loaded
    WAIT = "wait"                  # a full sync runs, or takes it along: look again soon
    RECOVERED = "recovered"        # routed at the fleet's version: the tending ends
    GIVE_UP = "give up"            # LOST: it keeps dying, or never reached the version
    LEAVE = "leave"                # not ours to tend (any more): the tending ends


@dataclass
class Tending:
    """One engine being brought back: why (None for a resync of a STALE engine), since
    when, how many relaunches so far, until when it may stay STALE, and, for one a sync
    found hung, until when its first answer is waited for."""

    engine: ManagedEngine
    reason: str | None = None
    t0: float = field(default_factory=time.time)
    relaunches: int = 0
    deadline: float = field(default_factory=lambda: time.monotonic() + RESYNC_TIMEOUT_S)
    answer_by: float | None = None

    @property
    def is_recovery(self) -> bool:
        return self.reason is not None

    def died(self, reason: str) -> None:
        """A death while tended: a resync becomes a recovery (the first reason stays)."""
        if self.reason is None:
            self.reason, self.t0 = reason, time.time()

    def back(self) -> None:
        """Relaunched or reattached: a fresh deadline to reach the fleet's version."""
        self.relaunches += 1
        self.deadline = time.monotonic() + RESYNC_TIMEOUT_S


class Recovery:
    """The advice for tended engines, and the record of every recovery."""

    def __init__(self) -> None:
        self.recoveries: list[dict] = []

    @staticmethod
    def next_step(t: Tending, *, closing: bool, syncing: bool) -> Step:
        """What `t.engine` needs now, from its phase alone (asked under the fleet's lock)."""
        e, phase = t.engine, t.engine.phase
        if closing:
            return Step.LEAVE
        if phase is P.DEAD:
            if t.relaunches >= MAX_RECOVERY_ATTEMPTS:
                return Step.GIVE_UP
            return Step.REATTACH if e.external_address is not None else Step.RELAUNCH
        if phase is P.REGISTERED:
            return Step.RECOVERED
        if phase is P.SUSPECT:
            if t.answer_by is None:
                return Step.LEAVE  # the health monitor's suspect: its probes decide
            return Step.PROBE if time.monotonic() < t.answer_by else Step.CALL_DEAD
        if phase is P.STALE:
            if not e.update_weights:
                return Step.ROUTE_FROZEN
            if time.monotonic() > t.deadline:
                return Step.GIVE_UP if t.is_recovery else Step.LEAVE
            return Step.WAIT if syncing else Step.RESYNC
        if phase in (P.UPDATING, P.UPDATING_ROUTED):
            return Step.WAIT  # an update has it (a full sync took it along)
        if phase in FOR_FULL_SYNC and t.is_recovery:
            return Step.WAIT
        return Step.LEAVE  # LOST, STOPPED, or waiting for the next full sync

    @staticmethod
    def answer_wait_s(health: HealthSettings) -> float:
        """How long a hung engine's tending waits for its first answer: twice the health
        monitor's budget for a death while the monitor runs, so that its verdict comes
        first; that budget once when it is off and the tending is the only judge. The
        budget: `failure_threshold` rounds, each `interval_s` apart, waiting up to
        LIVENESS_TIMEOUT_S for the actors (a cut-off node's answers nothing) and then the
        probe's `timeout_s`."""
        budget = health.failure_threshold * (health.interval_s + LIVENESS_TIMEOUT_S
                                             + health.timeout_s + 1.0)
        return budget * (2 if health.enabled else 1)

    def recovered(self, t: Tending, version: str) -> float:
        """Record a recovery that ended with the engine routed; its seconds."""
        took = round(time.time() - t.t0, 2)
        e = t.engine
        self.recoveries.append({"engine": e.engine_id, "reason": t.reason, "recovery_s": took,
                                "version": version, "url": e.url, "dead_at": e.dead_at})
        return took

    def failed(self, t: Tending, error: str) -> None:
        """Record a recovery that gave up (the run goes on with fewer engines)."""
        self.recoveries.append({"engine": t.engine.engine_id, "reason": t.reason,
                                "error": error})
