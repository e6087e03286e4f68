"""Fleet: the only owner of engines. It keeps the lock, the version and the update transaction.

Every engine of every model in the job's `--sglang-config` is a `ManagedEngine` here; no
other code creates engines, moves them between phases or adds/removes router workers. The
fleet decides (its supervision, `supervision.py`, applies the advice under the lock); its
parts do one concern each and advise, never move an engine:

    launcher.py    launch, attach, loaded, probe, kill, shutdown of one engine
    routers.py     every model's router: start, supervise, restart; add and remove workers
    health.py      how a death is noticed; its findings come back as `Verdict`s
    recovery.py    what a dead or STALE engine needs next (`Step`), and the recoveries' record
    offload.py     colocated engines' memory release and resume, and where each goes after
    generation.py  generation and scoring through the routers (`fleet.generate`, ...)
    draining.py    a drained engine's running requests: waited for, moved at the deadline

Membership changes while it runs (`membership.py`, a layer of the fleet like
`supervision.py`): `add_engines`, `drain`, `resize`.

A weight update is a context:

    with fleet.updating() as update:          # engines paused by the sync are UPDATING
        push(update.targets, update.version)  # any transport, from any process
    # success: every target verified at update.version is routed; the fleet is at that version
    # failure: every target not verified at the fleet's version leaves the router (STALE),
    #          is resumed, and is resynced before it serves again; one the sync found hung
    #          is SUSPECT: resynced once it answers, relaunched if the monitor calls it dead

and a full update with retries is a loop of attempts (`sync_attempts`, or `sync(push)`).
`move` adds an engine to its router only on entering a routed phase, and refuses one whose
verified version is not the fleet's, so the routing invariant holds by construction.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from slime_like.engine.fanout import each
from slime_like.errors import FleetError, WeightSyncError
from slime_like.fleet.attempts import SyncAttempts, Update, WeightSource
from slime_like.fleet.events import Happening
from slime_like.fleet.lifecycle import FOR_FULL_SYNC, SYNCABLE, ManagedEngine, Phase
from slime_like.fleet.membership import Membership
from slime_like.fleet.stream import RolloutStream
from slime_like.protocol.weight_version import WeightVersion, parse_weight_version
from slime_like.rollout.generate import RouterGenerator, Sample

__all__ = ["Fleet", "Update", "WeightSource"]

logger = logging.getLogger(__name__)
P = Phase


class Fleet(Membership):
    """Engines of every model in the job, their routers, health and recovery, engines
    added and drained; their weight updates and generation through their routers."""

    # ---- weight updates ---------------------------------------------------------------------

    def set_weight_source(self, source: WeightSource) -> None:
        """How the fleet puts the current weights into a replacement engine (the trainer)."""
        self.weight_source = source

    def sync_running(self, running: bool) -> None:
        """A full sync's attempts begin or end (`SyncAttempts`); at the end, every STALE
        engine gets its resync."""
        if running:
            self._syncing.set()
            return
        self._syncing.clear()
        self._tend_stale()

    def targets(self, engine_ids: Sequence[str] | None = None) -> list[ManagedEngine]:
        """The updatable engines an update may take now (all, or those of `engine_ids`)."""
        with self.lock:
            pool = [e for e in self.engines if e.update_weights and e.phase in SYNCABLE
                    and e.handle is not None]
        if engine_ids is not None:
            pool = [e for e in pool if e.engine_id in set(engine_ids)]
        return pool

    @contextlib.contextmanager
    def updating(self, engine_ids: Sequence[str] | None = None, *,
                 version: WeightVersion | None = None,
                 exclude: Collection[str] = ()) -> Iterator[Update]:
        """A weight update of the updatable engines (all syncable ones, or `engine_ids`),
        less `exclude` (engines that do not answer now: they stay STALE and are resynced
        once they do, or recovered).

        A full update installs the next version (or `version`, e.g. the loaded one after a
        resume); a resync (`engine_ids` given, no version) installs the current one. See
        the module docstring for what happens on exit.
        """
        full = engine_ids is None
        with self.lock:
            if full:
                if self._full_update.is_set():
                    raise FleetError("a full weight update is already in progress")
                self._full_update.set()
            chosen = [e for e in self.targets(engine_ids) if e.engine_id not in exclude]
            if not chosen:
                if full:
                    self._full_update.clear()
                raise FleetError("no engines to sync: " + ", ".join(
                    f"{e.engine_id} {e.state.value}" for e in self.engines if e.update_weights))
            update = Update(version if version is not None else
                            (self.version.next() if full else self.version),
                            [e.handle for e in chosen], full,
                            quiet=frozenset(e.url for e in chosen if e.phase is P.HELD))
            for e in chosen:  # a serving engine is paused in place, still routed
                self.move(e, P.UPDATING_ROUTED if e.routed else P.UPDATING,
                          version=str(update.version))
        try:
            yield update
        except BaseException as err:
            self._settle(chosen, update, failed=err)
            raise
        else:
            self._settle(chosen, update, failed=None)
        finally:
            if full:
                self._full_update.clear()

    def _settle(self, chosen: list[ManagedEngine], update: Update,
                failed: BaseException | None) -> None:
        """After a sync: route what is verified at the fleet's version, unroute the rest.

        After a failure nothing is verified: a transfer that stopped midway leaves weights
        that are partly new under the old version string, so every target resyncs. Unless
        no update request went out at all (`WeightSyncError.untouched`): then every target
        keeps the version it had, and a routed one stays routed.
        """
        verified: dict[str, WeightVersion | None] = {e.engine_id: None for e in chosen}
        # Engines the sync found hung (a call past its deadline while the others answered)
        # leave the router and the update now, as SUSPECT: waiting for the health monitor
        # would hold the next attempt, and every engine it pauses, for the monitor's whole
        # budget. They are not dead yet (a stopped process may be continued, a cut-off host
        # heal, a deadline be short for a loaded machine): resynced in place once they
        # answer, relaunched only once the monitor calls them dead (`suspect`).
        # A sync that found engines hung before any update went out left them behind and
        # landed on the others (`weights/left_behind.py`): the same verdict.
        why = {url: str(failed) for url in getattr(failed, "hung", None) or ()}
        if failed is None:
            why.update((update.report or {}).get("hung") or {})
        hung = set(why)
        for e in chosen:
            if e.url in hung:
                self.suspect(e, f"hung during a weight sync: {why[e.url]}")
        if failed is None:
            synced = set(update.report.get("engines") or [h.url for h in update.targets])
            pushed = parse_weight_version(update.report.get("weight_version")) or update.version
            verified = {e.engine_id: pushed if e.url in synced else None for e in chosen}
        elif getattr(failed, "untouched", False):
            # No update request reached any engine (it failed at the pause or begin, e.g.
            # on a hung engine): each still serves what it was verified at, so one that
            # was routed stays routed while the next attempt runs (the others resync).
            verified = {e.engine_id: e.verified_version if e.phase is P.UPDATING_ROUTED
                        else None for e in chosen}
            logger.warning("weight update to version %s failed before any weights moved: %s",
                           update.version, failed)
        else:
            logger.warning("weight update to version %s failed: %s", update.version, failed)
        with self.lock:
            if failed is None and update.full:
                self.version = update.version
                # wall_time: what the engines' served logs are read against (chaos/served.py)
                self.events.emit("fleet", Happening.VERSION, version=str(self.version),
                                 wall_time=round(time.time(), 4))
            for e in chosen:
                if e.url not in hung:  # a suspect's weights stay unverified
                    e.verified_version = verified[e.engine_id]
            # The router learns every verified engine at once (a registration waits for the
            # router to list it); one it refuses is tried again by its move, then resyncs.
            each([e for e in chosen if e.phase is P.UPDATING
                  and e.verified_version == self.version], self._route)
            for e in chosen:
                if e.phase not in (P.UPDATING, P.UPDATING_ROUTED):
                    continue  # declared dead meanwhile; its recovery owns it
                if e.verified_version == self.version:
                    try:
                        self.move(e, P.REGISTERED, version=str(self.version))
                        continue
                    except Exception as err:  # noqa: BLE001 - the engine resyncs instead
                        logger.warning("%s: could not be routed: %s", e.engine_id, err)
                self.move(e, P.STALE, version=str(e.verified_version),
                          reason="weights not verified at the fleet's version")
            for e in self.engines:
                if update.full and e.phase in FOR_FULL_SYNC:
                    self.move(e, P.STALE)  # not taken along: a resync of its own
                elif e.phase is P.REGISTERED and e.update_weights \
                        and e.verified_version != self.version:
                    self.move(e, P.STALE, reason="version moved on")
        if failed is not None:
            # Resumed only now, after the unverified engines left the router.
            answering = [e for e in chosen if e.url not in hung]
            each(answering,
                 lambda e: e.handle.continue_generation(timeout=self.settings.verify_timeout_s))
            # Failures are the health monitor's to find, deaths ours. Not a suspect's: an
            # actor on a cut-off host would hold the settle for the liveness call's timeout.
            alive = self.launcher.alive_all(answering)
            for e in answering:
                if not alive[e.engine_id]:
                    self.start_recovery(e, "server gone after a failed weight update")
        self._after_update(chosen, update, failed)  # drained engines stop after a regroup
        self._tend_stale()

    def sync_attempts(self, retries: int = 3, wait_for_engines_s: float = 600.0,
                      version: WeightVersion | None = None) -> SyncAttempts:
        """The attempts of one full update, each an `updating()` of the living engines:

            for attempt in fleet.sync_attempts():
                with attempt as update:
                    update.report = push(update)

        A failed attempt (WeightSyncError, FleetError) is followed by another for the
        engines that still answer, `retries` times; the last failure raises. With every
        engine dead or relaunching it waits (bounded) for one to come back instead of
        failing the run. Replacement resyncs wait while it runs (retries included).
        """
        return SyncAttempts(self, retries, wait_for_engines_s, version)

    def sync(self, push: Callable[[Update], dict | None], retries: int = 3,
             wait_for_engines_s: float = 600.0, version: WeightVersion | None = None) -> dict:
        """A full update through `push`, retried for the living engines after a failure."""
        for attempt in self.sync_attempts(retries, wait_for_engines_s, version):
            with attempt as update:
                update.report = push(update) or {}
        return update.report

    def coming_back(self) -> list[str]:
        """Updatable engines dead or on their way back (an attempt may wait for them)."""
        with self.lock:
            return [e.engine_id for e in self.engines if e.update_weights
                    and e.phase in (P.DEAD, P.RELAUNCHING, P.REATTACHING)]

    def unresponsive(self, engines: list[ManagedEngine]) -> set[str]:
        """Which of `engines` do not answer /ping within a second; a dead one is recovered."""
        if not engines:
            return set()
        with ThreadPoolExecutor(len(engines)) as pool:
            quiet = [e for e, ok in zip(engines, pool.map(self.launcher.answers, engines),
                                        strict=True) if not ok]
        for e in quiet:
            if not self.launcher.alive(e):
                self.start_recovery(e, "server gone after a failed weight update")
        return {e.engine_id for e in quiet}

    def _resync(self, e: ManagedEngine) -> None:
        """One update of `e` alone at the fleet's version, through the weight source."""
        if self.weight_source is None:
            raise FleetError(f"{e.engine_id}: no weight source to resync it (set_weight_source)")
        try:
            with self.updating([e.engine_id]) as update:
                update.report = self.weight_source(update) or {}
        except (WeightSyncError, FleetError) as err:
            logger.warning("%s: resync failed (%s); retrying", e.engine_id, err)
            time.sleep(0.5)
            return
        if e.phase is not P.REGISTERED:
            time.sleep(0.5)  # e.g. the router is being relaunched

    # ---- generation (generation.py) ---------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, sampling_params: dict,
                 on_sample: Callable[[int], None] | None = None,
                 model: str | None = None) -> list[Sample]:
        """Generate through the model's router (n samples per prompt, with logprobs)."""
        return self.generation.generate(prompts, n, sampling_params, on_sample, model)

    def generator(self, model: str | None = None,
                  **options: Any) -> contextlib.AbstractContextManager[RouterGenerator]:
        """A generator through the model's router whose in-flight requests are resubmitted
        when an engine stops answering (`options`: RouterGenerator's)."""
        return self.generation.generator(model, **options)

    def stream(self, prompts: Any, *, n: int, sampling_params: dict, batch_size: int,
               max_staleness: int = 1, partial_rollout: bool = False,
               model: str | None = None) -> RolloutStream:
        """Generation that never waits for the caller: batches of groups pulled with
        `next_batch()` while weight pushes update the engines in flight (`stream.py`)."""
        return RolloutStream(self.generation, lambda: self.version, self.subscribe, prompts,
                             n=n, sampling_params=sampling_params, batch_size=batch_size,
                             max_staleness=max_staleness, partial_rollout=partial_rollout,
                             model=model)

    def token_logprobs(self, pairs: Sequence[tuple[list[int], list[int]]],
                       model: str) -> list[list[float]]:
        """log p(output tokens | prompt) under `model` (e.g. a frozen reference), through its
        router: per pair (prompt_ids, output_ids), one logprob per output token."""
        return self.generation.token_logprobs(pairs, model)
