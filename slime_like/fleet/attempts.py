"""The attempts of one full weight update, retried for the engines that still answer.

    for attempt in fleet.sync_attempts():
        with attempt as update:
            update.report = push(update)

Each attempt opens a `Fleet.updating()`; a failure inside it (WeightSyncError, FleetError)
is swallowed when another attempt follows, leaving out the engines that no longer answer.
The last failure raises. While the attempts run, resyncs of replacement engines wait
(`Fleet.syncing`); when they end, the STALE engines get their resyncs. The attempts drive
the fleet through `Updates`, the few calls of its update transaction they need.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from slime_like.engine.session import EngineSession
from slime_like.errors import FleetError, WeightSyncError
from slime_like.fleet.lifecycle import ManagedEngine
from slime_like.protocol.weight_version import WeightVersion

logger = logging.getLogger(__name__)


@dataclass
class Update:
    """One weight update in progress: the engines it covers and the version it installs."""

    version: WeightVersion
    targets: list[EngineSession]
    full: bool
    report: dict = field(default_factory=dict)
    # URLs of targets held out of the router with nothing running since their memory came
    # back (HELD, `offloaded(hold_for_sync=True)`): the push need not pause or continue them.
    quiet: frozenset[str] = frozenset()


# push(update): put the weights of `update.version` into `update.targets` (the trainer).
WeightSource = Callable[[Update], Any]


class Updates(Protocol):
    """The fleet's update transaction, as the attempts drive it (`Fleet` is one)."""

    engines: list[ManagedEngine]

    def updating(self, engine_ids: Sequence[str] | None = None, *,
                 version: WeightVersion | None = None,
                 exclude: Collection[str] = ()) -> contextlib.AbstractContextManager[Update]: ...

    def targets(self, engine_ids: Sequence[str] | None = None) -> list[ManagedEngine]: ...

    def coming_back(self) -> list[str]: ...

    def unresponsive(self, engines: list[ManagedEngine]) -> set[str]: ...

    def sync_running(self, running: bool) -> None: ...


def wait_for_syncable(fleet: Updates, timeout: float,
                      excluded: Collection[str] = frozenset()) -> set[str]:
    """Wait (bounded) until an engine not in `excluded` can be synced; returns the engines
    still to leave out (an excluded engine that answers again is taken back)."""
    excluded = set(excluded)
    deadline = time.monotonic() + timeout
    last_check = time.monotonic()
    while True:
        targets = fleet.targets(None)
        if any(e.engine_id not in excluded for e in targets):
            return excluded
        if excluded and time.monotonic() - last_check > 1.0:
            excluded = fleet.unresponsive([e for e in targets if e.engine_id in excluded])
            last_check = time.monotonic()
            continue
        if not (fleet.coming_back() or excluded) or time.monotonic() > deadline:
            raise FleetError("no engines to sync: " + ", ".join(
                f"{e.engine_id} {e.state.value}"
                + (" (not answering)" if e.engine_id in excluded else "")
                for e in fleet.engines if e.update_weights))
        time.sleep(0.1)


class SyncAttempts:
    """The attempts of one full update (`Fleet.sync_attempts`); iterate, enter each."""

    def __init__(self, fleet: Updates, retries: int, wait_s: float,
                 version: WeightVersion | None):
        self.fleet = fleet
        self.retries = retries
        self.wait_s = wait_s
        self.version = version
        self.attempt = 0
        self.excluded: set[str] = set()
        self.done = False
        fleet.sync_running(True)

    def __iter__(self) -> SyncAttempts:
        return self

    def __next__(self) -> SyncAttempt:
        if self.done:
            raise StopIteration
        return SyncAttempt(self)

    def failed(self, err: BaseException) -> bool:
        """After a failed attempt: True if another follows (leaving out who does not answer)."""
        if self.attempt >= self.retries:
            self.finish()
            return False
        # Give the exit watchers and probes a moment, then leave out whatever does not
        # answer now (a kill between attempts would fail them all). Not when the attempt
        # failed on engines it found hung (past a deadline while the others answered):
        # the fleet holds those out (SUSPECT) until they answer or are called dead, and
        # the others (out of the router since the failure) would wait for nothing.
        hung = bool(getattr(err, "hung", None))
        if not hung:
            time.sleep(min(2.0, 0.25 * 2 ** self.attempt))
        self.attempt += 1
        candidates = self.fleet.targets(None)
        # Engines the failed attempt found taking no control call (e.g. never answering
        # their group join) are left out as well; the health monitor relaunches them if
        # their scheduler stays stuck.
        named = set(getattr(err, "unresponsive", None) or ())
        # Right after a hang (no pause above), the engines that answered the sync's own
        # ping after the failure are not asked again: a second round of pings to every
        # engine, on the step's critical path, would tell nothing new.
        answered = set(getattr(err, "answering", None) or ()) if hung else set()
        self.excluded = self.fleet.unresponsive(
            [e for e in candidates if e.url not in answered]) | {
            e.engine_id for e in candidates if e.url in named}
        logger.warning("weight sync failed (%s); retrying for the living engines%s", err,
                       f" (leaving out {sorted(self.excluded)} for now)" if self.excluded else "")
        return True

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.fleet.sync_running(False)


class SyncAttempt:
    """One attempt: entering it opens the update (its `Update`); a failure inside is
    swallowed when another attempt follows."""

    def __init__(self, run: SyncAttempts):
        self.run = run
        self._context: contextlib.AbstractContextManager[Update] | None = None

    def __enter__(self) -> Update:
        run, fleet = self.run, self.run.fleet
        while True:
            try:
                run.excluded = wait_for_syncable(fleet, run.wait_s, run.excluded)
            except BaseException:
                run.finish()
                raise
            self._context = fleet.updating(version=run.version, exclude=run.excluded)
            try:
                return self._context.__enter__()
            except (WeightSyncError, FleetError) as err:
                # Opening failed (e.g. no engine left to sync): that attempt is spent.
                if not run.failed(err):
                    raise
            except BaseException:
                run.finish()
                raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self._context is not None
        try:
            self._context.__exit__(exc_type, exc, tb)
        except BaseException:
            self.run.finish()
            raise
        if exc is None:
            self.run.finish()
            return False
        if isinstance(exc, WeightSyncError | FleetError) and self.run.failed(exc):
            return True  # the next attempt follows
        self.run.finish()
        return False
