"""Fleet: the only owner of engines — launch, lifecycle, router membership, recovery.

Every engine of every model in the job's `--sglang-config` is a `ManagedEngine` here; no
other code creates engines, moves them between states or adds/removes router workers.
The health monitor and the weight sync report to the fleet and hold no lifecycle state.

A weight update is a context:

    with fleet.updating() as update:          # engines paused by the sync are UPDATING
        push(update.targets, update.version)  # any transport, from any process
    # success: every target verified at update.version is routed; the fleet is at that version
    # failure: every target not verified at the fleet's version leaves the router (STALE),
    #          is resumed, and is resynced before it serves again

`route()` refuses an engine whose verified version is not the fleet's current version, so
the invariant of DESIGN §3 holds by construction. A dead engine is relaunched on its own
bundle as soon as the death is seen, synced by the weight source (the trainer), checked,
and only then routed; the others keep serving. An external engine (someone else's server,
`--rollout-external-engine-addrs`) is attached instead of launched, and after a death the
fleet waits (bounded) for it to come back at its address instead of relaunching it.
Colocated engines give their memory back around a train step with `offloaded()`.
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

import ray

from slime_like.cluster.placement import JobPlacement
from slime_like.config.layout import EnginePlacement
from slime_like.config.slices import FleetSettings
from slime_like.engine.actor import EngineActor, crash_server
from slime_like.engine.external import CHECKED_FIELDS, ExternalEngine
from slime_like.engine.from_placement import engine_config
from slime_like.engine.handle import EngineHandle
from slime_like.errors import SlimeLikeError, WeightSyncError
from slime_like.protocol.weight_version import WeightVersion, parse_weight_version
from slime_like.rollout.generate import RouterGenerator, Sample
from slime_like.rollout.health import HealthMonitor, HealthPolicy
from slime_like.rollout.lifecycle import SYNCABLE, EngineState, ManagedEngine
from slime_like.rollout.offload import OffloadMixin
from slime_like.rollout.scoring import token_logprobs
from slime_like.router.client import RouterClient
from slime_like.router.router import Router

logger = logging.getLogger(__name__)

# A recovery whose relaunched server dies too starts over, this many times at most.
MAX_RECOVERY_ATTEMPTS = 5

S = EngineState
EventSink = Callable[..., None]
# push(update): put the weights of `update.version` into `update.targets` (the trainer).
WeightSource = Callable[["Update"], Any]


class FleetError(SlimeLikeError):
    """The fleet cannot do what was asked (no engines to sync, routing refused, ...)."""


@dataclass
class Update:
    """One weight update in progress: the engines it covers and the version it installs."""

    version: WeightVersion
    targets: list[EngineHandle]
    full: bool
    report: dict = field(default_factory=dict)


class Fleet(OffloadMixin):
    """Engines of every model in the job, their routers, health and recovery."""

    def __init__(self, settings: FleetSettings, placement: JobPlacement,
                 on_event: EventSink | None = None):
        self.settings = settings
        self.placement = placement
        self.log_dir = Path(settings.log_dir)
        self._sinks: list[EventSink] = [on_event] if on_event else []
        self.routers: dict[str, Router] = {}
        self.engines: list[ManagedEngine] = []
        self.version = WeightVersion(0)
        self.recoveries: list[dict] = []
        self.weight_source: WeightSource | None = None
        self.monitor: HealthMonitor | None = None
        self._lock = threading.RLock()
        self._recovering: set[str] = set()  # relaunch in progress
        self._resyncing: set[str] = set()   # a STALE engine's resync thread is running
        self._full_update = threading.Event()
        self._syncing = threading.Event()  # a full sync with its retries is running
        self._closing = False
        self._on_shutdown: list[Callable[[], None]] = []
        # Parked `wait_exit` calls on every engine actor: a server's exit is known at once.
        self._exit_refs: dict[Any, tuple[str, int]] = {}
        self._exit_lock = threading.Lock()
        self._exit_thread: threading.Thread | None = None
        self.router_restarts: list[dict] = []
        self._generators: set[RouterGenerator] = set()
        self.last_generation: dict = {}
        # Released without a weight backup: only the next full sync may bring them back.
        self._awaiting_full_sync: set[str] = set()
        plan = placement.plan
        for router in plan.routers:
            by_engine: dict[int, list[EnginePlacement]] = {}
            for p in plan.engines_of(router.model_name):
                by_engine.setdefault(p.engine_index, []).append(p)
            for _, ps in sorted(by_engine.items()):
                ps.sort(key=lambda p: p.node_rank)
                cfg = engine_config(ps[0], settings.engine, model_path=self._model_path(ps[0]))
                self.engines.append(ManagedEngine(
                    ps[0].engine_id, router.model_name, ps, router.update_weights,
                    tp_size=max(1, ps[0].num_gpus // cfg.pp_size)))
        if settings.external_addrs:
            model = self.updatable_model
            for i, addr in enumerate(settings.external_addrs):
                self.engines.append(ManagedEngine(f"{model}/external/e{i}", model, [], True,
                                                  external_address=addr))

    def _model_path(self, p: EnginePlacement) -> str:
        return self.settings.model_paths.get(p.model_name) or p.model_path or ""

    # ---- events ----------------------------------------------------------------------------

    def subscribe(self, sink: EventSink) -> None:
        """Call `sink(engine_id, state, **details)` on every lifecycle event."""
        self._sinks.append(sink)

    def _emit(self, subject: str, state: str, **details: Any) -> None:
        for sink in list(self._sinks):
            try:
                sink(subject, state, **details)
            except Exception:  # noqa: BLE001 - a broken sink must not break the lifecycle
                logger.exception("event sink failed")

    def _move(self, e: ManagedEngine, dst: EngineState, **details: Any) -> None:
        """The one place engine states change (the table in lifecycle.py is enforced)."""
        src = e.move(dst)
        self._emit(e.engine_id, dst.value, previous=src.value, **details)

    # ---- router membership (the only code that adds or removes workers) ---------------------

    def router_url(self, model: str | None = None) -> str:
        """The URL to generate through for `model` (default: the updatable model)."""
        return self.routers[model or self.updatable_model].url

    @property
    def updatable_model(self) -> str:
        names = [r.model_name for r in self.placement.plan.routers if r.update_weights]
        return names[0] if names else self.placement.plan.routers[0].model_name

    def _supervise(self, model: str, router: Router) -> None:
        """A router that dies is relaunched at once on its port, its workers re-added."""
        router.process.on_exit(lambda code: threading.Thread(
            target=self._restart_router, args=(model, router, code),
            name=f"restart-router-{model}", daemon=True).start())

    def _restart_router(self, model: str, router: Router, code: int) -> None:
        if self._closing:
            return
        t0 = time.time()
        self._emit(f"router/{model}", "DEAD", code=code)
        logger.warning("router of %s exited with code %s; relaunching on port %s", model, code,
                       router.port)
        try:
            router.restart()
        except Exception as err:  # noqa: BLE001 - without a router the run cannot go on
            logger.exception("router of %s could not be relaunched", model)
            self._emit(f"router/{model}", "FAILED", error=str(err))
            return
        with self._lock:
            routed = [e for e in self.engines if e.model_name == model and e.routed]
            for e in routed:
                e.routed, e.router_worker_id = False, None
                try:
                    self.route(e)
                except Exception as err:  # noqa: BLE001 - it resyncs or recovers instead
                    logger.warning("%s: not re-added to the new router: %s", e.engine_id, err)
                    if e.state is S.REGISTERED:
                        self._move(e, S.STALE, reason=f"router restart: {err}")
        took = round(time.time() - t0, 2)
        self.router_restarts.append({"model": model, "code": code, "restart_s": took,
                                     "url": router.url, "at": t0})
        self._emit(f"router/{model}", "READY", url=router.url, pid=router.process.pid,
                   restart_s=took, workers=len(routed))
        self._supervise(model, router)
        self._resync_stale_later()

    def _router_client(self, e: ManagedEngine) -> RouterClient:
        return self.routers[e.model_name].client

    def route(self, e: ManagedEngine) -> None:
        """Add an engine to its router; refused unless it serves the fleet's version."""
        if e.update_weights and e.verified_version != self.version:
            raise FleetError(f"engine {e.engine_id} serves version {e.verified_version}, the "
                             f"fleet is at {self.version}: not routed")
        if e.routed or e.handle is None:
            return
        h = e.handle
        if h.worker_type == "encoder":
            return
        info = self._router_client(e).add_worker(h.url, worker_type=h.worker_type,
                                                 bootstrap_port=h.bootstrap_port,
                                                 api_key=h.api_key,
                                                 timeout=self.settings.register_timeout_s)
        e.routed, e.router_worker_id = True, info.id

    def _unroute(self, e: ManagedEngine) -> None:
        if not e.routed or e.handle is None:
            return
        client = self._router_client(e)
        try:
            client.remove_worker(e.router_worker_id, url=e.handle.url, timeout=15)
            # The id we hold may be stale (the router re-keyed the worker): make sure the
            # URL itself is gone before anyone relies on it being out.
            if client.find_worker(e.handle.url) is not None:
                client.remove_worker(url=e.handle.url, timeout=15)
        except Exception as err:  # noqa: BLE001 - a dead router takes its workers with it
            logger.warning("%s: removal from the router failed: %s", e.engine_id, err)
        e.routed, e.router_worker_id = False, None

    # ---- launch ----------------------------------------------------------------------------

    def _launch(self, e: ManagedEngine) -> Any:
        """Create the engine's node actors and start their servers; an ObjectRef of the URL."""
        e.actors = [EngineActor.options(**self.placement.engine_options(p)).remote(
            engine_config(p, self.settings.engine, model_path=self._model_path(p),
                          log_dir=str(self.log_dir))) for p in e.placements]
        dist_init = None
        if len(e.actors) > 1:
            dist_init = ray.get(e.actors[0].reserve_dist_init_addr.remote())
        refs = [a.init.remote(dist_init) for a in e.actors]
        return refs[0]

    def _attach(self, e: ManagedEngine) -> dict:
        """An external engine: check `/server_info` against the job's flags, make its handle,
        and see it generate once (a server that just came back may still be warming up)."""
        eng = self.settings.engine
        # model_path is the owner's business (their path, their machine); names, dtypes and
        # shapes are checked by the weight sync's metadata check before any byte moves.
        expected = {k: v for k, v in eng.sglang_flags.items()
                    if k in CHECKED_FIELDS and k != "model_path"}
        ext = ExternalEngine(e.external_address, expected=expected, api_key=eng.api_key,
                             admin_api_key=eng.admin_api_key)
        url = ext.init()
        e.tp_size = int(ext.info.get("tp_size") or 1)
        e.handle = EngineHandle(url, e.tp_size, api_key=eng.api_key,
                                admin_api_key=eng.admin_api_key, engine_id=e.engine_id,
                                worker_type=ext.config.worker_type,
                                bootstrap_port=ext.bootstrap_port)
        e.handle.health_generate(timeout=30.0)
        e.verified_version = parse_weight_version(e.handle.weight_version())
        return {"url": url, "version": str(e.verified_version), "external": True}

    def _watch_exit(self, e: ManagedEngine) -> None:
        """Park `wait_exit` on each of the engine's actors; the watcher thread sees it return."""
        with self._exit_lock:
            for a in e.actors:
                self._exit_refs[a.wait_exit.remote(None)] = (e.engine_id, e.restarts)
        if self._exit_thread is None:
            self._exit_thread = threading.Thread(target=self._exit_watcher, name="engine-exits",
                                                 daemon=True)
            self._exit_thread.start()

    def _exit_watcher(self) -> None:
        while not self._closing:
            with self._exit_lock:
                refs = list(self._exit_refs)
            if not refs:
                time.sleep(0.1)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
            for ref in ready:
                with self._exit_lock:
                    engine_id, generation = self._exit_refs.pop(ref)
                try:
                    code = ray.get(ref)
                    why = f"server process exited with code {code}"
                except Exception as err:  # noqa: BLE001 - the actor died with its node
                    why = f"engine actor lost: {type(err).__name__}"
                e = self.find(engine_id)
                if e.restarts == generation and not self._closing:
                    self._on_dead(engine_id, why)

    def _loaded(self, e: ManagedEngine) -> dict:
        e.handle = ray.get(e.actors[0].handle.remote(e.tp_size))
        e.verified_version = parse_weight_version(e.handle.weight_version())
        return {"url": e.handle.url, "pid": ray.get(e.actors[0].server_pid.remote()),
                "version": str(e.verified_version)}

    def start(self) -> Fleet:
        """Routers, then every engine concurrently. Frozen models' engines are routed at once;
        the updatable model's wait (LOADED) for the first sync."""
        for plan in self.placement.plan.routers:
            router = Router(pd_disaggregation=plan.pd_disaggregation,
                            router_flags=self.settings.router.flags, log_dir=self.log_dir,
                            api_key=self.settings.router.api_key,
                            name=f"router-{plan.model_name}",
                            port=self.settings.router_port
                            if plan.model_name == self.updatable_model else None).start()
            self.routers[plan.model_name] = router
            self._emit(f"router/{plan.model_name}", "READY", url=router.url,
                       metrics=router.prometheus_url, pid=router.process.pid)
            self._supervise(plan.model_name, router)
        refs = {}
        for e in self.engines:
            self._emit(e.engine_id, S.LAUNCHING.value)
            if e.external_address is None:
                refs[e.engine_id] = self._launch(e)
        for e in self.engines:
            if e.external_address is not None:
                with self._lock:
                    self._move(e, S.LOADED, **self._attach(e))
                continue
            ray.get(refs[e.engine_id])
            with self._lock:
                self._move(e, S.LOADED, **self._loaded(e))
                if not e.update_weights:  # frozen: it serves its checkpoint as loaded
                    e.verified_version = None
                    self._frozen_route(e)
            self._watch_exit(e)
        health = self.settings.health
        if health.enabled:
            self.monitor = HealthMonitor(
                self._probe, self._alive, self._on_dead,
                HealthPolicy(interval_s=health.interval_s, timeout_s=health.timeout_s,
                             failure_threshold=health.failure_threshold,
                             first_wait_s=health.first_wait_s),
                should_probe=self._should_probe, on_suspect=self._on_suspect,
                on_healthy=self._on_healthy)
            for e in self.engines:
                self.monitor.watch(e.engine_id)
            self.monitor.start()
        return self

    def _frozen_route(self, e: ManagedEngine) -> None:
        self._move(e, S.UPDATING, reason="frozen model: serves its checkpoint")
        self.route(e)
        self._move(e, S.REGISTERED, version="frozen")

    # ---- weight updates ------------------------------------------------------------------------

    def set_weight_source(self, source: WeightSource) -> None:
        """How the fleet puts the current weights into a replacement engine (the trainer)."""
        self.weight_source = source

    def _targets(self, engine_ids: Sequence[str] | None) -> list[ManagedEngine]:
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
        resume); a resync (`engine_ids` given, no version) installs the current one. See the module docstring for what happens on exit.
        """
        full = engine_ids is None
        with self._lock:
            if full:
                if self._full_update.is_set():
                    raise FleetError("a full weight update is already in progress")
                self._full_update.set()
            chosen = [e for e in self._targets(engine_ids) if e.engine_id not in exclude]
            if not chosen:
                if full:
                    self._full_update.clear()
                raise FleetError("no engines to sync: " + ", ".join(
                    f"{e.engine_id} {e.state.value}" for e in self.engines if e.update_weights))
            update = Update(version if version is not None else
                            (self.version.next() if full else self.version),
                            [e.handle for e in chosen], full)
            for e in chosen:
                self._move(e, S.UPDATING, version=str(update.version))
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
        with self._lock:
            if failed is None and update.full:
                self.version = update.version
                self._emit("fleet", "VERSION", version=str(self.version))
            if update.full:  # taken along (or failed, and resynced like any STALE engine)
                self._awaiting_full_sync.clear()
            for e in chosen:
                e.verified_version = verified[e.engine_id]
                if e.state is not S.UPDATING:
                    continue  # declared dead meanwhile; recovery owns it
                if e.verified_version == self.version:
                    try:
                        self.route(e)
                        self._move(e, S.REGISTERED, version=str(self.version))
                        continue
                    except Exception as err:  # noqa: BLE001 - the engine resyncs instead
                        logger.warning("%s: could not be routed: %s", e.engine_id, err)
                self._unroute(e)
                self._move(e, S.STALE, version=str(e.verified_version),
                           reason="weights not verified at the fleet's version")
            # A version bump strands any routed engine still at the old one.
            for e in self.engines:
                if e.routed and e.update_weights and e.verified_version != self.version \
                        and e.state is not S.UPDATING:
                    self._unroute(e)
                    self._move(e, S.STALE, reason="version moved on")
        if failed is not None:
            # Resumed only now, after the unverified engines left the router.
            self._resume(chosen)
            self._probe_dead(chosen)
        self._resync_stale_later()

    def _resume(self, chosen: list[ManagedEngine]) -> None:
        def resume(e: ManagedEngine) -> None:
            with contextlib.suppress(Exception):
                e.handle.client.continue_generation(timeout=self.settings.verify_timeout_s)
        with ThreadPoolExecutor(max(1, len(chosen))) as pool:
            list(pool.map(resume, chosen))

    def _probe_dead(self, chosen: list[ManagedEngine]) -> None:
        for e in chosen:
            if not self._alive(e.engine_id):
                self._on_dead(e.engine_id, "server gone after a failed weight update")

    def sync(self, push: Callable[[Update], dict | None], retries: int = 3,
             wait_for_engines_s: float = 600.0, version: WeightVersion | None = None) -> dict:
        """A full update through `push`, retried for the living engines after a failure.

        With every engine dead or relaunching it waits (bounded) for one to come back
        instead of failing the run. Replacement resyncs wait while it runs (retries
        included): each attempt takes the STALE engines along.
        """
        self._syncing.set()
        excluded: set[str] = set()
        try:
            for attempt in range(retries + 1):
                excluded = self._wait_for_syncable(wait_for_engines_s, excluded)
                try:
                    with self.updating(version=version, exclude=excluded) as update:
                        update.report = push(update) or {}
                    return update.report
                except (WeightSyncError, FleetError) as err:
                    if attempt == retries:
                        raise
                    # Give the exit watchers and probes a moment, then leave out whatever
                    # does not answer now (a kill between attempts would fail them all).
                    time.sleep(min(2.0, 0.25 * 2 ** attempt))
                    with self._lock:
                        candidates = self._targets(None)
                    # Engines the failed attempt found taking no control call (e.g. never
                    # answering their group join) are left out as well; the health monitor
                    # relaunches them if their scheduler stays stuck.
                    named = set(getattr(err, "unresponsive", None) or ())
                    excluded = self._unresponsive(candidates) | {
                        e.engine_id for e in candidates if e.url in named}
                    logger.warning("weight sync failed (%s); retrying for the living engines%s",
                                   err, f" (leaving out {sorted(excluded)} for now)"
                                   if excluded else "")
            raise AssertionError("unreachable")
        finally:
            self._syncing.clear()
            self._resync_stale_later()

    def _wait_for_syncable(self, timeout: float, excluded: set[str] = frozenset()) -> set[str]:
        """Wait (bounded) until an engine not in `excluded` can be synced; returns the
        engines still to leave out (an excluded engine that answers again is taken back)."""
        deadline = time.monotonic() + timeout
        last_check = time.monotonic()
        while True:
            with self._lock:
                targets = self._targets(None)
            if any(e.engine_id not in excluded for e in targets):
                return set(excluded)
            if excluded and time.monotonic() - last_check > 1.0:
                excluded = self._unresponsive([e for e in targets if e.engine_id in excluded])
                last_check = time.monotonic()
                continue
            with self._lock:
                coming = [e.engine_id for e in self.engines if e.update_weights
                          and e.state in (S.DEAD, S.RELAUNCHING, S.REATTACHING)]
            if not (coming or excluded) or time.monotonic() > deadline:
                raise FleetError("no engines to sync: " + ", ".join(
                    f"{e.engine_id} {e.state.value}"
                    + (" (not answering)" if e.engine_id in excluded else "")
                    for e in self.engines if e.update_weights))
            time.sleep(0.1)

    def _unresponsive(self, engines: list[ManagedEngine]) -> set[str]:
        """Which of `engines` do not answer /ping within a second; a dead one is recovered."""
        def answers(e: ManagedEngine) -> bool:
            try:
                return e.handle is not None and e.handle.client.ping(timeout=1.0)
            except Exception:  # noqa: BLE001 - not answering is the finding
                return False
        if not engines:
            return set()
        with ThreadPoolExecutor(len(engines)) as pool:
            quiet = [e for e, ok in zip(engines, pool.map(answers, engines), strict=True) if not ok]
        for e in quiet:
            if not self._alive(e.engine_id):
                self._on_dead(e.engine_id, "server gone after a failed weight update")
        return {e.engine_id for e in quiet}

    # ---- health ----------------------------------------------------------------------------------

    def find(self, engine_id: str) -> ManagedEngine:
        for e in self.engines:
            if e.engine_id == engine_id:
                return e
        raise KeyError(engine_id)

    def _should_probe(self, engine_id: str) -> bool:
        return self.find(engine_id).state in (S.REGISTERED, S.SUSPECT, S.LOADED, S.STALE,
                                              S.UPDATING, S.OFFLOADED)

    def _probe(self, engine_id: str, timeout: float) -> None:
        """A real generation step; while paused for an update (where /health_generate
        blocks by design) only that the server still answers (/ping), so a hang during a
        sync is still found."""
        e = self.find(engine_id)
        if e.state in (S.UPDATING, S.OFFLOADED):  # paused, or memory released: 503 by design
            if not e.handle.client.ping(timeout=timeout):
                raise FleetError(f"{e.engine_id}: /ping unanswered while {e.state.value}")
            return
        e.handle.health_generate(timeout=timeout)

    def _alive(self, engine_id: str) -> bool:
        e = self.find(engine_id)
        if e.external_address is not None:
            return e.handle is not None and e.handle.client.ping(timeout=2.0)
        try:
            return all(ray.get([a.is_alive.remote() for a in e.actors], timeout=10))
        except Exception:  # noqa: BLE001 - an actor that cannot answer is not alive
            return False

    def _on_suspect(self, engine_id: str, why: str) -> None:
        """First failed probe: out of the router at once (recovered or declared dead later).

        An engine paused for an update that stops answering `/ping` leaves the router too,
        without changing state: the update's end routes it again only if it verified.
        """
        with self._lock:
            e = self.find(engine_id)
            if e.state is S.REGISTERED:
                self._unroute(e)
                self._move(e, S.SUSPECT, reason=why)
            elif e.state is S.UPDATING and e.routed:
                self._unroute(e)
                self._emit(e.engine_id, "UNROUTED", reason=why)
            else:
                return
            # Requests stuck on it are sent again now; the first answer wins.
            for gen in self._generators:
                gen.resubmit_in_flight()

    def _on_healthy(self, engine_id: str) -> None:
        with self._lock:
            e = self.find(engine_id)
            if e.state is not S.SUSPECT:
                return
            if not e.update_weights or e.verified_version == self.version:
                self.route(e)
                self._move(e, S.REGISTERED, reason="probes pass again")
            else:
                self._move(e, S.STALE, reason="probes pass again, version moved on")
        self._resync_stale_later()

    def kill_engine(self, index: int = 0, *, model: str | None = None, node_rank: int = 0) -> str:
        """SIGKILL one engine's server, as a real crash would (the demo and tests).

        `index` counts all engines, or those of `model`; `node_rank` picks the node of a
        multi-node engine. External engines are never killed by us.
        """
        pool = self.engines if model is None else [e for e in self.engines
                                                    if e.model_name == model]
        e = pool[index]
        if e.external_address is not None:
            raise FleetError(f"{e.engine_id} is external: it is never killed by the job")
        crash_server(e.actors[node_rank], timeout=None)
        logger.warning("simulated a crash of %s node %d (%s)", e.engine_id, node_rank, e.url)
        return e.engine_id

    # ---- recovery ------------------------------------------------------------------------------

    def _on_dead(self, engine_id: str, reason: str) -> None:
        with self._lock:
            if self._closing:
                return
            e = self.find(engine_id)
            if engine_id in self._recovering:
                # Relaunched (or back), then dead again before its recovery ended: the
                # recovery sees DEAD, stops resyncing and starts over (or, if it had just
                # finished, a new one starts).
                if e.state not in (S.DEAD, S.STOPPED, S.RELAUNCHING, S.REATTACHING):
                    e.died_while_recovering = reason
                    self._unroute(e)
                    self._move(e, S.DEAD, reason=reason)
                    if self.monitor is not None:
                        self.monitor.unwatch(engine_id)
                return
            if e.state in (S.DEAD, S.STOPPED, S.RELAUNCHING, S.REATTACHING):
                return
            self._recovering.add(engine_id)
            self._unroute(e)  # before anything else: no request may reach a dead engine
            self._move(e, S.DEAD, reason=reason)
            if self.monitor is not None:
                self.monitor.unwatch(engine_id)
        threading.Thread(target=self._recover, args=(e, reason), name=f"recover-{engine_id}",
                         daemon=True).start()

    def _recover(self, e: ManagedEngine, reason: str) -> None:
        t0 = time.time()
        try:
            for attempt in range(1, MAX_RECOVERY_ATTEMPTS + 1):
                try:
                    if not self._bring_back(e):
                        return  # the fleet is shutting down
                    break
                except Exception as err:
                    with self._lock:
                        again, e.died_while_recovering = e.died_while_recovering, None
                    if again is None or self._closing or attempt == MAX_RECOVERY_ATTEMPTS:
                        raise
                    logger.warning("%s died again before its recovery finished (%s); "
                                   "recovering it again (attempt %d of %d): %s", e.engine_id,
                                   again, attempt + 1, MAX_RECOVERY_ATTEMPTS, err)
            took = time.time() - t0
            self.recoveries.append({"engine": e.engine_id, "reason": reason,
                                    "recovery_s": round(took, 2), "version": str(self.version),
                                    "url": e.url, "dead_at": e.dead_at})
            self._emit(e.engine_id, "RECOVERED", recovery_s=round(took, 2))
            logger.warning("%s recovered in %.1fs at version %s (%s)", e.engine_id, took,
                           self.version, e.url)
        except Exception as err:  # noqa: BLE001 - report it; the run goes on with fewer engines
            logger.exception("%s: recovery failed", e.engine_id)
            self.recoveries.append({"engine": e.engine_id, "reason": reason,
                                    "error": f"{type(err).__name__}: {err}"})
            with self._lock:
                if e.state not in (S.DEAD, S.STOPPED):
                    self._unroute(e)
                    self._move(e, S.DEAD, reason=f"recovery failed: {err}")
        finally:
            with self._lock:
                again, e.died_while_recovering = e.died_while_recovering, None
                if again is None or self._closing:
                    self._recovering.discard(e.engine_id)
            if again is not None and not self._closing:  # died just as it was routed again
                threading.Thread(target=self._recover, args=(e, again),
                                 name=f"recover-{e.engine_id}", daemon=True).start()

    def _bring_back(self, e: ManagedEngine) -> bool:
        """Relaunch (or reattach) a dead engine and bring it to the fleet's version; False if
        the fleet is shutting down."""
        back = self._reattach(e) if e.external_address is not None else self._relaunch(e)
        if not back:
            return False
        if self.monitor is not None:
            self.monitor.watch(e.engine_id)
        if not e.update_weights:
            with self._lock:
                self._frozen_from_stale(e)
        else:
            self._resync(e)
        return True

    def _relaunch(self, e: ManagedEngine) -> bool:
        """Our engine: kill what is left of it, start it again on its bundle (STALE); False
        if the fleet is shutting down."""
        for a in e.actors:
            with contextlib.suppress(Exception):  # the actor may have died with its server
                ray.get(a.shutdown.remote(1.0), timeout=30)  # dead or hung: no grace
            ray.kill(a)
        with self._lock:
            if self._closing:
                return False
            self._move(e, S.RELAUNCHING)
        e.restarts += 1
        ray.get(self._launch(e))
        with self._lock:
            self._move(e, S.STALE, **self._loaded(e))
        self._watch_exit(e)
        return True

    def _reattach(self, e: ManagedEngine) -> bool:
        """An external engine: wait (bounded) for its owner to bring it back, then STALE;
        False if the fleet is shutting down."""
        with self._lock:
            if self._closing:
                return False
            self._move(e, S.REATTACHING, address=e.external_address,
                       wait_s=self.settings.external_wait_s)
        deadline = time.monotonic() + self.settings.external_wait_s
        while True:
            try:
                loaded = self._attach(e)
                break
            except Exception as err:  # noqa: BLE001 - not back yet (refused, warming up, ...)
                if self._closing:
                    return False
                if time.monotonic() >= deadline:
                    raise FleetError(f"{e.engine_id}: not back at {e.external_address} after "
                                     f"{self.settings.external_wait_s:g}s "
                                     f"(--external-engine-reconnect-timeout): {err}") from err
                time.sleep(0.5)
        e.restarts += 1
        with self._lock:
            self._move(e, S.STALE, **loaded)
        return True

    def _frozen_from_stale(self, e: ManagedEngine) -> None:
        self._move(e, S.UPDATING, reason="frozen model: serves its checkpoint")
        self.route(e)
        self._move(e, S.REGISTERED)

    def _resync(self, e: ManagedEngine, timeout: float = 600.0) -> None:
        """Bring a STALE engine to the fleet's version and route it (or let a full sync do it)."""
        if self.weight_source is None:
            raise FleetError(f"{e.engine_id}: no weight source to resync it (set_weight_source)")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._closing:
            if e.state is S.REGISTERED:
                return  # a full sync took it along
            if e.state in (S.DEAD, S.STOPPED, S.RELAUNCHING, S.REATTACHING):
                raise FleetError(f"{e.engine_id}: {e.state.value} while waiting to resync")
            if e.state is not S.STALE or self._full_update.is_set() or self._syncing.is_set():
                time.sleep(0.05)
                continue
            try:
                with self.updating([e.engine_id]) as update:
                    update.report = self.weight_source(update) or {}
            except (WeightSyncError, FleetError) as err:
                logger.warning("%s: resync failed (%s); retrying", e.engine_id, err)
                time.sleep(0.5)
                continue
            if e.state is not S.REGISTERED:
                time.sleep(0.5)  # e.g. the router is being relaunched
        if e.state is not S.REGISTERED:
            if self._closing:
                raise FleetError(f"{e.engine_id}: the fleet closed before it was resynced")
            raise FleetError(f"{e.engine_id}: not at version {self.version} after {timeout:.0f}s")

    def _resync_stale_later(self) -> None:
        """STALE engines not already being recovered get their own resync thread."""
        if self.weight_source is None or self._closing:
            return
        with self._lock:
            skip = self._recovering | self._resyncing | self._awaiting_full_sync
            stale = [e for e in self.engines if e.state is S.STALE and e.update_weights
                     and e.engine_id not in skip]
            for e in stale:
                self._resyncing.add(e.engine_id)
        for e in stale:
            threading.Thread(target=self._resync_then_release, args=(e,),
                             name=f"resync-{e.engine_id}", daemon=True).start()

    def _resync_then_release(self, e: ManagedEngine) -> None:
        try:
            self._resync(e)
        except Exception as err:  # noqa: BLE001 - stays STALE; the next full sync takes it along
            logger.warning("%s: resync stopped: %s", e.engine_id, err)
        finally:
            with self._lock:
                self._resyncing.discard(e.engine_id)

    def wait_recovered(self, timeout: float = 300.0) -> bool:
        """Block until no recovery or resync is running (True) or the timeout passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._recovering and not self._resyncing:
                    return True
            time.sleep(0.1)
        return False

    # ---- generation and views ---------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, sampling_params: dict,
                 on_sample: Callable[[int], None] | None = None,
                 model: str | None = None) -> list[Sample]:
        """Generate through the model's router (n samples per prompt, with logprobs)."""
        model = model or self.updatable_model
        router = self.routers[model]
        count = sum(1 for e in self.engines if e.model_name == model)
        gen = RouterGenerator(router.url, api_key=self.settings.router.api_key,
                              concurrency=self.settings.engine.server_concurrency * max(1, count),
                              request_timeout_s=self.settings.router.request_timeout_s)
        with self._lock:
            self._generators.add(gen)
        try:
            samples = gen.generate(prompts, n, sampling_params, on_sample)
        finally:
            with self._lock:
                self._generators.discard(gen)
        self.last_generation = {"requested": len(prompts) * n, "returned": len(samples),
                                "resubmitted": gen.resubmitted}
        return samples

    def token_logprobs(self, pairs: Sequence[tuple[list[int], list[int]]],
                       model: str) -> list[list[float]]:
        """log p(output tokens | prompt) under `model` (e.g. a frozen reference), through its
        router: per pair (prompt_ids, output_ids), one logprob per output token."""
        count = sum(1 for e in self.engines if e.model_name == model)
        return token_logprobs(self.routers[model].url, pairs,
                              api_key=self.settings.router.api_key,
                              concurrency=self.settings.engine.server_concurrency * max(1, count),
                              timeout_s=self.settings.router.request_timeout_s)

    @property
    def reference_model(self) -> str | None:
        """The first frozen model (update_weights: false), the KL term's reference."""
        return next((r.model_name for r in self.placement.plan.routers
                     if not r.update_weights), None)

    def states(self) -> dict[str, str]:
        with self._lock:
            return {e.engine_id: e.state.value for e in self.engines}

    def handles(self, model: str | None = None) -> list[EngineHandle]:
        """Handles of the engines serving now (REGISTERED), for callers of their own."""
        with self._lock:
            return [e.handle for e in self.engines if e.state is S.REGISTERED and e.handle
                    and (model is None or e.model_name == model)]

    def metrics_urls(self) -> dict[str, str]:
        """Every engine's and router's Prometheus address (for the report and the console)."""
        out = {f"router/{m}": r.prometheus_url for m, r in self.routers.items()}
        out.update({e.engine_id: e.handle.metrics_url() for e in self.engines if e.handle})
        return out

    # ---- teardown -------------------------------------------------------------------------------

    def on_shutdown(self, fn: Callable[[], None]) -> None:
        """Run `fn` after the engines and routers are stopped (e.g. release the placement)."""
        self._on_shutdown.append(fn)

    def stop_engine(self, index: int) -> str:
        """SIGSTOP one engine's server: a hang, found by probes, not by its exit (chaos)."""
        e = self.engines[index]
        ray.get(e.actors[0].suspend.remote())
        logger.warning("suspended %s (%s)", e.engine_id, e.url)
        return e.engine_id

    def kill_router(self, model: str | None = None) -> None:
        """SIGKILL a router, as a real crash would (the chaos test)."""
        self.routers[model or self.updatable_model].process.kill()

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
        if self.monitor is not None:
            self.monitor.stop()
        for e in self.engines:
            with self._lock:
                self._unroute(e)
                if e.state is not S.STOPPED:
                    self._move(e, S.STOPPED)
            for a in e.actors:
                try:
                    ray.get(a.shutdown.remote(), timeout=30)
                except Exception as err:  # noqa: BLE001 - keep tearing the rest down
                    logger.warning("%s: shutdown failed: %s", e.engine_id, err)
                ray.kill(a)
        for router in self.routers.values():
            router.stop()
        for fn in self._on_shutdown:
            fn()
        self._on_shutdown.clear()
