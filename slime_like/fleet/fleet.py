"""Fleet: the only owner of engines. It keeps the lock, the version and the update transaction.

Every engine of every model in the job's `--sglang-config` is a `ManagedEngine` here; no
other code creates engines, moves them between states or adds/removes router workers. The
fleet's parts each own one concern and report to it:

    launcher.py   launch, attach, loaded, probe, kill, shutdown of one engine
    routers.py    every model's router: start, supervise, restart; add and remove workers
    health.py     how a death is noticed (the exit watcher; probes with thresholds and a
                  cold-start grace) and the verdicts: SUSPECT, healthy again, dead
    recovery.py   one way back from a death: start_recovery(engine, reason); resyncs
    offload.py    colocated engines give their memory back around a train step

A weight update is a context:

    with fleet.updating() as update:          # engines paused by the sync are UPDATING
        push(update.targets, update.version)  # any transport, from any process
    # success: every target verified at update.version is routed; the fleet is at that version
    # failure: every target not verified at the fleet's version leaves the router (STALE),
    #          is resumed, and is resynced before it serves again

and a full update with retries is a loop of attempts (`sync_attempts`, or `sync(push)`).
`route()` refuses an engine whose verified version is not the fleet's current version, so
the routing invariant holds by construction.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_like.cluster.placement import JobPlacement
from slime_like.config.slices import FleetSettings
from slime_like.engine.session import EngineSession, each
from slime_like.errors import FleetError
from slime_like.fleet.attempts import SyncAttempts
from slime_like.fleet.events import EngineState, EventBus, EventSink, Happening
from slime_like.fleet.health import FleetHealth
from slime_like.fleet.launcher import Launcher
from slime_like.fleet.lifecycle import SYNCABLE, ManagedEngine, records_from_plan
from slime_like.fleet.offload import Offload
from slime_like.fleet.recovery import Recovery
from slime_like.fleet.routers import Routers
from slime_like.fleet.stream import RolloutStream
from slime_like.protocol.weight_version import WeightVersion, parse_weight_version
from slime_like.rollout.generate import RouterGenerator, Sample
from slime_like.rollout.scoring import token_logprobs

logger = logging.getLogger(__name__)

S = EngineState
# Re-adding an engine to a relaunched router: one that served a moment ago registers in
# well under a second; one that takes longer is hung and resyncs instead.
REROUTE_TIMEOUT_S = 10.0
# push(update): put the weights of `update.version` into `update.targets` (the trainer).
WeightSource = Callable[["Update"], Any]


@dataclass
class Update:
    """One weight update in progress: the engines it covers and the version it installs."""

    version: WeightVersion
    targets: list[EngineSession]
    full: bool
    report: dict = field(default_factory=dict)
    # URLs of targets held out of the router with nothing running since their memory came
    # back (`offloaded(hold_for_sync=True)`): the push need not pause or continue them.
    quiet: frozenset[str] = frozenset()


class Fleet:
    """Engines of every model in the job, their routers, health and recovery."""

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
        self._generators: set[RouterGenerator] = set()
        self.last_generation: dict = {}
        self.engines = records_from_plan(placement.plan, settings)
        self.launcher = Launcher(settings, placement, self.log_dir)
        self.routers = Routers(settings, list(placement.plan.routers), self.updatable_model,
                               self.log_dir, self.events)
        self.routers.on_restarted = self._reroute
        self.recovery = Recovery(self)
        self.health = FleetHealth(self)
        self.offload = Offload(self)

    # ---- events and moves ------------------------------------------------------------------

    def subscribe(self, sink: EventSink) -> None:
        """Call `sink(event)` with every `FleetEvent` (engine and router states, happenings)."""
        self.events.subscribe(sink)

    def move(self, e: ManagedEngine, dst: EngineState, **details: Any) -> None:
        """The one place engine states change (the table in lifecycle.py is enforced)."""
        src = e.move(dst)
        self.events.emit(e.engine_id, dst, src, **details)

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

    def route(self, e: ManagedEngine, timeout: float | None = None, *,
              if_answering: bool = False) -> None:
        """Add an engine to its router; refused unless it serves the fleet's version."""
        if e.update_weights and e.verified_version != self.version:
            raise FleetError(f"engine {e.engine_id} serves version {e.verified_version}, the "
                             f"fleet is at {self.version}: not routed")
        self.routers.add(e, timeout, if_answering=if_answering)

    def unroute(self, e: ManagedEngine) -> None:
        self.routers.remove(e)

    def resubmit_in_flight(self) -> None:
        """Requests that may be stuck on an engine that stopped answering go out again."""
        with self.lock:
            for gen in self._generators:
                gen.resubmit_in_flight()

    def _reroute(self, model: str) -> int:
        """After a router's relaunch: its engines re-added (or resync) at once, each within
        REROUTE_TIMEOUT_S (a hung one would hide behind the lock from the health monitor),
        if they answer /health now. Not those in a sync (paused: no /health answer); its
        settle routes them. The router cannot cancel a registration it still probes."""
        with self.lock:
            routed = [e for e in self.engines if e.model_name == model and e.routed]
            for e in routed:
                self.routers.forget(e)
            routed = [e for e in routed if e.state is not S.UPDATING]
            outcomes = each(routed, lambda e: self.route(e, REROUTE_TIMEOUT_S, if_answering=True))
            for e, (_, err) in zip(routed, outcomes, strict=True):
                if err is not None:  # it resyncs or recovers instead
                    logger.warning("%s: not re-added to the new router: %s", e.engine_id, err)
                    if e.state is S.REGISTERED:
                        self.move(e, S.STALE, reason=f"router restart: {err}")
        self.recovery.resync_stale_later()
        return len(routed)

    # ---- start ------------------------------------------------------------------------------

    def start(self) -> Fleet:
        """Routers, then every engine concurrently. Frozen models' engines are routed at once;
        the updatable model's wait (LOADED) for the first sync."""
        self.routers.start()
        refs = {}
        for e in self.engines:
            self.events.emit(e.engine_id, S.LAUNCHING)
            if e.external_address is None:
                refs[e.engine_id] = self.launcher.launch(e)
        for e in self.engines:
            if e.external_address is not None:
                with self.lock:
                    self.move(e, S.LOADED, **self.launcher.attach(e))
                continue
            self.launcher.wait_launched(refs[e.engine_id])
            with self.lock:
                self.move(e, S.LOADED, **self.launcher.loaded(e))
                if not e.update_weights:  # frozen: it serves its checkpoint as loaded
                    e.verified_version = None
                    self.route_frozen(e, version="frozen")
            self.health.watch_exit(e)
        self.health.start()
        return self

    def route_frozen(self, e: ManagedEngine, **details: Any) -> None:
        """A frozen model's engine serves its checkpoint: routed without a sync."""
        self.move(e, S.UPDATING, reason="frozen model: serves its checkpoint")
        self.route(e)
        self.move(e, S.REGISTERED, **details)

    # ---- weight updates ---------------------------------------------------------------------

    def set_weight_source(self, source: WeightSource) -> None:
        """How the fleet puts the current weights into a replacement engine (the trainer)."""
        self.weight_source = source

    @property
    def update_in_progress(self) -> bool:
        """A full update is open: engines may already serve its version."""
        return self._full_update.is_set()

    @property
    def syncing(self) -> bool:
        """A full update is open or about to be retried (resyncs wait for it)."""
        return self._full_update.is_set() or self._syncing.is_set()

    def targets(self, engine_ids: Sequence[str] | None = None) -> list[ManagedEngine]:
        """The updatable engines an update may take now (all, or those of `engine_ids`)."""
        pool = [e for e in self.engines if e.update_weights and e.state in SYNCABLE
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
                            quiet=frozenset(e.url for e in chosen if e.held_for_sync))
            for e in chosen:  # leaving STALE ends a hold: a retry pauses it like any other
                self.move(e, S.UPDATING, version=str(update.version))
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
        that are partly new under the old version string, so every target resyncs.
        """
        verified: dict[str, WeightVersion | None] = {e.engine_id: None for e in chosen}
        if failed is None:
            synced = set(update.report.get("engines") or [h.url for h in update.targets])
            pushed = parse_weight_version(update.report.get("weight_version")) or update.version
            verified = {e.engine_id: pushed if e.url in synced else None for e in chosen}
        else:
            logger.warning("weight update to version %s failed: %s", update.version, failed)
        with self.lock:
            if failed is None and update.full:
                self.version = update.version
                self.events.emit("fleet", Happening.VERSION, version=str(self.version))
            if update.full:  # taken along (or failed, and resynced like any STALE engine)
                for e in self.engines:
                    e.awaiting_full_sync = False
            for e in chosen:
                e.verified_version = verified[e.engine_id]
                if e.state is not S.UPDATING:
                    continue  # declared dead meanwhile; recovery owns it
                if e.verified_version == self.version:
                    try:
                        self.route(e)
                        self.move(e, S.REGISTERED, version=str(self.version))
                        continue
                    except Exception as err:  # noqa: BLE001 - the engine resyncs instead
                        logger.warning("%s: could not be routed: %s", e.engine_id, err)
                self.unroute(e)
                self.move(e, S.STALE, version=str(e.verified_version),
                          reason="weights not verified at the fleet's version")
            # A version bump strands any routed engine still at the old one.
            for e in self.engines:
                if e.routed and e.update_weights and e.verified_version != self.version \
                        and e.state is not S.UPDATING:
                    self.unroute(e)
                    self.move(e, S.STALE, reason="version moved on")
        if failed is not None:
            # Resumed only now, after the unverified engines left the router.
            self._resume(chosen)
            for e in chosen:
                if not self.launcher.alive(e):
                    self.recovery.start_recovery(e, "server gone after a failed weight update")
        self.recovery.resync_stale_later()

    def _resume(self, chosen: list[ManagedEngine]) -> None:
        # failures are the health monitor's to find
        each(chosen, lambda e: e.handle.continue_generation(timeout=self.settings.verify_timeout_s))

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

    def wait_for_syncable(self, timeout: float, excluded: set[str] = frozenset()) -> set[str]:
        """Wait (bounded) until an engine not in `excluded` can be synced; returns the
        engines still to leave out (an excluded engine that answers again is taken back)."""
        deadline = time.monotonic() + timeout
        last_check = time.monotonic()
        while True:
            with self.lock:
                targets = self.targets(None)
            if any(e.engine_id not in excluded for e in targets):
                return set(excluded)
            if excluded and time.monotonic() - last_check > 1.0:
                excluded = self.unresponsive([e for e in targets if e.engine_id in excluded])
                last_check = time.monotonic()
                continue
            with self.lock:
                coming = [e.engine_id for e in self.engines if e.update_weights
                          and e.state in (S.DEAD, S.RELAUNCHING, S.REATTACHING)]
            if not (coming or excluded) or time.monotonic() > deadline:
                raise FleetError("no engines to sync: " + ", ".join(
                    f"{e.engine_id} {e.state.value}"
                    + (" (not answering)" if e.engine_id in excluded else "")
                    for e in self.engines if e.update_weights))
            time.sleep(0.1)

    def unresponsive(self, engines: list[ManagedEngine]) -> set[str]:
        """Which of `engines` do not answer /ping within a second; a dead one is recovered."""
        if not engines:
            return set()
        with ThreadPoolExecutor(len(engines)) as pool:
            quiet = [e for e, ok in zip(engines, pool.map(self.launcher.answers, engines),
                                        strict=True) if not ok]
        for e in quiet:
            if not self.launcher.alive(e):
                self.recovery.start_recovery(e, "server gone after a failed weight update")
        return {e.engine_id for e in quiet}

    # ---- colocated engines ------------------------------------------------------------------

    def offloaded(self, tags: Sequence[str] | None = None, *, hold_for_sync: bool = False):
        """Colocated engines release their memory for the body (see `fleet/offload.py`)."""
        return self.offload.offloaded(tags, hold_for_sync=hold_for_sync)

    # ---- generation and views ---------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, sampling_params: dict,
                 on_sample: Callable[[int], None] | None = None,
                 model: str | None = None) -> list[Sample]:
        """Generate through the model's router (n samples per prompt, with logprobs)."""
        with self.generator(model) as gen:
            samples = gen.generate(prompts, n, sampling_params, on_sample)
        self.last_generation = {"requested": len(prompts) * n, "returned": len(samples),
                                "resubmitted": gen.resubmitted}
        return samples

    @contextlib.contextmanager
    def generator(self, model: str | None = None, **options: Any) -> Iterator[RouterGenerator]:
        """A generator through the model's router, known to the fleet while it is open: the
        requests it has in flight are resubmitted when an engine stops answering.
        `options` are RouterGenerator's (e.g. keep_mixed_versions, partial_rollout)."""
        model = model or self.updatable_model
        count = sum(1 for e in self.engines if e.model_name == model)
        gen = RouterGenerator(self.routers.url(model), api_key=self.settings.router.api_key,
                              concurrency=self.settings.engine.server_concurrency * max(1, count),
                              request_timeout_s=self.settings.router.request_timeout_s,
                              **options)
        with self.lock:
            self._generators.add(gen)
        try:
            yield gen
        finally:
            with self.lock:
                self._generators.discard(gen)

    def stream(self, prompts: Any, *, n: int, sampling_params: dict, batch_size: int,
               max_staleness: int = 1, partial_rollout: bool = False,
               model: str | None = None) -> RolloutStream:
        """Generation that never waits for the caller: batches of groups pulled with
        `next_batch()` while weight pushes update the engines in flight
        (`fleet/stream.py`)."""
        return RolloutStream(self, prompts, n=n, sampling_params=sampling_params,
                             batch_size=batch_size, max_staleness=max_staleness,
                             partial_rollout=partial_rollout, model=model)

    def token_logprobs(self, pairs: Sequence[tuple[list[int], list[int]]],
                       model: str) -> list[list[float]]:
        """log p(output tokens | prompt) under `model` (e.g. a frozen reference), through its
        router: per pair (prompt_ids, output_ids), one logprob per output token."""
        count = sum(1 for e in self.engines if e.model_name == model)
        return token_logprobs(self.routers.url(model), pairs,
                              api_key=self.settings.router.api_key,
                              concurrency=self.settings.engine.server_concurrency * max(1, count),
                              timeout_s=self.settings.router.request_timeout_s)

    def states(self) -> dict[str, str]:
        with self.lock:
            return {e.engine_id: e.state.value for e in self.engines}

    def handles(self, model: str | None = None) -> list[EngineSession]:
        """Handles of the engines serving now (REGISTERED), for callers of their own."""
        with self.lock:
            return [e.handle for e in self.engines if e.state is S.REGISTERED and e.handle
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

    def wait_recovered(self, timeout: float = 300.0) -> bool:
        """Block until no recovery or resync is running (True) or the timeout passes."""
        return self.recovery.wait_idle(timeout)

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
        for e in self.engines:
            with self.lock:
                self.unroute(e)
                if e.state is S.LAUNCHING:
                    self.move(e, S.STOPPED, reason=f"{reason or 'the fleet shut down'} while "
                                                   "it was launching: it never served")
                elif e.state is not S.STOPPED:
                    self.move(e, S.STOPPED, **({"reason": reason} if reason else {}))
            self.launcher.shutdown(e)
        self.routers.stop()
        for fn in self._on_shutdown:
            fn()
        self._on_shutdown.clear()
