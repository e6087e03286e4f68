"""RolloutManager: routers, engine actors, the engine lifecycle and crash recovery.

Lifecycle of one engine (DESIGN.md §3), owned here:

    LAUNCHING -> LOADED -> REGISTERED <-> UPDATING
    any -> DEAD -> RELAUNCHING -> STALE -> (synced, version verified) -> REGISTERED

Invariant: an engine is in its router only while its weight version equals the trainer's
current version. A replacement is launched as soon as the death is seen (not at the next
weight update), receives the served version from the trainer over its own weight group,
and only then joins the router; the healthy engines keep serving all along.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from slime_like.cluster.placement import JobPlacement
from slime_like.config.layout import EnginePlacement
from slime_like.engine.actor import EngineActor
from slime_like.engine.from_placement import engine_config
from slime_like.engine.handle import EngineHandle
from slime_like.rollout.generate import RouterGenerator, Sample
from slime_like.rollout.health import HealthMonitor, HealthPolicy
from slime_like.router.client import RouterClient
from slime_like.router.router import Router

logger = logging.getLogger(__name__)


class EngineState(str, enum.Enum):
    LAUNCHING = "LAUNCHING"
    LOADED = "LOADED"
    REGISTERED = "REGISTERED"
    UPDATING = "UPDATING"
    DEAD = "DEAD"
    RELAUNCHING = "RELAUNCHING"
    STALE = "STALE"


@dataclass
class ManagedEngine:
    """One engine (all its node actors) and where it is in its lifecycle."""

    engine_id: str
    placements: list[EnginePlacement]
    actors: list[Any] = field(default_factory=list)
    url: str | None = None
    state: EngineState = EngineState.LAUNCHING
    version: str | None = None
    restarts: int = 0
    dead_at: float | None = None

    tp_size: int = 1
    handle: EngineHandle | None = None  # HTTP verbs of node 0, read from its actor once serving

    @property
    def head(self) -> Any:
        return self.actors[0]


EventSink = Callable[..., None]


class RolloutManager:
    """Starts and supervises the engines of the updatable model behind its router."""

    def __init__(self, args: Any, placement: JobPlacement, model_path: str, log_dir: Path,
                 on_event: EventSink | None = None):
        self.args = args
        self.placement = placement
        self.model_path = model_path
        self.log_dir = Path(log_dir)
        self.on_event = on_event or (lambda *a, **k: None)
        self.router: Router | None = None
        self.engines: list[ManagedEngine] = []
        self.trainer = None  # rank-0 trainer actor, for syncing recovered engines
        self.trainer_version = 0
        self.recoveries: list[dict] = []
        self._lock = threading.RLock()
        self._recovering: set[str] = set()
        self._closing = False
        self._updating = threading.Event()  # set while a full sync is in progress
        self.monitor: HealthMonitor | None = None
        model = next(m for m in placement.plan.routers if m.update_weights) \
            if any(m.update_weights for m in placement.plan.routers) else placement.plan.routers[0]
        self.model_name = model.model_name
        self.pd = model.pd_disaggregation
        by_engine: dict[int, list[EnginePlacement]] = {}
        for p in placement.plan.engines_of(self.model_name):
            by_engine.setdefault(p.engine_index, []).append(p)
        for _, ps in sorted(by_engine.items()):
            ps.sort(key=lambda p: p.node_rank)
            pp = engine_config(ps[0], args, model_path=model_path).pp_size
            self.engines.append(ManagedEngine(ps[0].engine_id, ps, tp_size=ps[0].num_gpus // pp))

    # ---- start -------------------------------------------------------------------------------

    def _set(self, engine: ManagedEngine, state: EngineState, **details: Any) -> None:
        engine.state = state
        self.on_event(engine.engine_id, state.value, **details)

    def _launch(self, engine: ManagedEngine) -> Any:
        """Create the engine's node actors and start their servers; an ObjectRef of the URL."""
        engine.actors = [EngineActor.options(**self.placement.engine_options(p)).remote(
            engine_config(p, self.args, model_path=self.model_path, log_dir=str(self.log_dir)))
            for p in engine.placements]
        dist_init = None
        if len(engine.actors) > 1:
            dist_init = ray.get(engine.head.reserve_dist_init_addr.remote())
        refs = [a.init.remote(dist_init) for a in engine.actors]
        return refs[0]

    def start(self) -> None:
        """The router, then every engine concurrently; engines end LOADED (not yet routed)."""
        self.router = Router(pd_disaggregation=self.pd, router_flags=self.args.router_flags,
                             log_dir=self.log_dir, name=f"router-{self.model_name}").start()
        self.on_event("router", "READY", url=self.router.url, pid=self.router.process.pid)
        refs = {}
        for e in self.engines:
            self._set(e, EngineState.LAUNCHING)
            refs[e.engine_id] = self._launch(e)
        for e in self.engines:
            e.url = ray.get(refs[e.engine_id])
            e.handle = ray.get(e.head.handle.remote(e.tp_size))
            e.version = e.handle.weight_version()
            self._set(e, EngineState.LOADED, url=e.url, version=e.version,
                      pid=ray.get(e.head.server_pid.remote()))
        if self.args.use_fault_tolerance:
            self.monitor = HealthMonitor(self._probe, self._alive, self._on_dead, HealthPolicy(
                interval_s=self.args.rollout_health_check_interval,
                timeout_s=self.args.rollout_health_check_timeout,
                failure_threshold=self.args.rollout_health_check_failures,
                first_wait_s=self.args.rollout_health_check_first_wait))
            for e in self.engines:
                self.monitor.watch(e.engine_id)
            self.monitor.start()

    def attach_trainer(self, trainer_rank0: Any) -> None:
        self.trainer = trainer_rank0

    def sync_targets(self) -> list[tuple[str, int]]:
        """(URL, TP size) of every engine a full sync should reach now."""
        with self._lock:
            return [(e.url, e.tp_size) for e in self.engines
                    if e.url and e.state in (EngineState.LOADED, EngineState.REGISTERED,
                                             EngineState.UPDATING)]

    # ---- weight updates ----------------------------------------------------------------------

    def begin_update(self) -> None:
        """Engines are about to be paused: stop readiness probes (a paused /health blocks)."""
        with self._lock:
            self._updating.set()
            for e in self.engines:
                if e.state in (EngineState.REGISTERED, EngineState.LOADED):
                    self._set(e, EngineState.UPDATING)
                    if self.monitor:
                        self.monitor.pause(e.engine_id)

    def end_update(self, version: int, synced_urls: list[str] | None = None) -> None:
        """The trainer reports `version` on the engines it synced; register any not yet routed."""
        with self._lock:
            self.trainer_version = version
            synced = set(synced_urls or [])
            for e in self.engines:
                if e.state is not EngineState.UPDATING:
                    continue
                if synced_urls is not None and e.url not in synced:
                    continue
                e.version = str(version)
                self._register(e)
                if self.monitor:
                    self.monitor.resume(e.engine_id)
            self._updating.clear()

    def _register(self, e: ManagedEngine) -> None:
        assert self.router is not None and e.handle is not None
        RouterClient(self.router.url).add_worker(e.handle.url, worker_type=e.handle.worker_type,
                                                 bootstrap_port=e.handle.bootstrap_port,
                                                 api_key=e.handle.api_key)
        self._set(e, EngineState.REGISTERED, version=e.version)

    # ---- generation --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, sampling_params: dict,
                 on_sample: Callable[[int], None] | None = None) -> list[Sample]:
        assert self.router is not None
        gen = RouterGenerator(self.router.url,
                              concurrency=self.args.sglang_server_concurrency * max(1, len(self.engines)))
        return gen.generate(prompts, n, sampling_params, on_sample)

    # ---- failure and recovery -------------------------------------------------------------------

    def _find(self, engine_id: str) -> ManagedEngine:
        return next(e for e in self.engines if e.engine_id == engine_id)

    def _probe(self, engine_id: str, timeout: float) -> None:
        e = self._find(engine_id)
        assert e.handle is not None
        e.handle.health_generate(timeout)

    def _alive(self, engine_id: str) -> bool:
        e = self._find(engine_id)
        return all(ray.get([a.is_alive.remote() for a in e.actors], timeout=10))

    def simulate_crash(self, index: int = 0) -> str:
        """SIGKILL one engine's server, as a real crash would (for the demo and tests)."""
        e = self.engines[index]
        ray.get(e.head.simulate_crash.remote())
        logger.warning("simulated a crash of %s (%s)", e.engine_id, e.url)
        return e.engine_id

    def _on_dead(self, engine_id: str, reason: str) -> None:
        with self._lock:
            if self._closing or engine_id in self._recovering:
                return
            self._recovering.add(engine_id)
            e = self._find(engine_id)
            e.dead_at = time.time()
            self._set(e, EngineState.DEAD, reason=reason)
        threading.Thread(target=self._recover, args=(e, reason), name=f"recover-{engine_id}",
                         daemon=True).start()

    def _recover(self, e: ManagedEngine, reason: str) -> None:
        t0 = time.time()
        try:
            old_url = e.url
            if self.router is not None and old_url:
                try:
                    RouterClient(self.router.url).remove_worker(url=old_url, timeout=15)
                except Exception as err:  # noqa: BLE001 - the worker may be gone already
                    logger.warning("%s: router removal failed: %s", e.engine_id, err)
            if self.trainer is not None and old_url:
                ray.get(self.trainer.remove_engine.remote(old_url))
            for a in e.actors:
                # The actor may have died with its server; the kill below covers that.
                with contextlib.suppress(Exception):
                    ray.get(a.shutdown.remote(), timeout=30)
                ray.kill(a)
            with self._lock:
                if self._closing:
                    return
                self._set(e, EngineState.RELAUNCHING)
            e.restarts += 1
            e.url = ray.get(self._launch(e))
            e.handle = ray.get(e.head.handle.remote(e.tp_size))
            e.version = e.handle.weight_version()
            with self._lock:
                self._set(e, EngineState.STALE, url=e.url, version=e.version,
                          pid=ray.get(e.head.server_pid.remote()))
            if self.trainer is None:
                raise RuntimeError("no trainer attached to sync the replacement")
            ray.get(self.trainer.sync_new_engine.remote(e.url, e.tp_size))
            # A full sync may have started meanwhile (it includes this engine from now on):
            # register only once it is over, and only at the version the others serve.
            while True:
                with self._lock:
                    if not self._updating.is_set():
                        served = e.handle.weight_version()
                        if served != str(self.trainer_version):
                            raise RuntimeError(f"replacement serves version {served}, the others "
                                               f"serve {self.trainer_version}")
                        e.version = served
                        self._register(e)
                        if self.monitor:
                            self.monitor.watch(e.engine_id)
                        break
                time.sleep(0.1)
            took = time.time() - t0
            self.recoveries.append({"engine": e.engine_id, "reason": reason,
                                    "recovery_s": round(took, 2), "version": served,
                                    "url": e.url})
            logger.warning("%s recovered in %.1fs at version %s (%s)", e.engine_id, took, served,
                           e.url)
        except Exception as err:  # noqa: BLE001 - report it; the run goes on with fewer engines
            logger.exception("%s: recovery failed", e.engine_id)
            self.recoveries.append({"engine": e.engine_id, "reason": reason,
                                    "error": f"{type(err).__name__}: {err}"})
            with self._lock:
                self._set(e, EngineState.DEAD, reason=f"recovery failed: {err}")
        finally:
            with self._lock:
                self._recovering.discard(e.engine_id)

    def wait_recovered(self, timeout: float = 300.0) -> bool:
        """Block until no recovery is running (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._recovering:
                    return True
            time.sleep(0.2)
        return False

    def states(self) -> dict[str, str]:
        with self._lock:
            return {e.engine_id: e.state.value for e in self.engines}

    # ---- teardown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
        if self.monitor is not None:
            self.monitor.stop()
        for e in self.engines:
            for a in e.actors:
                try:
                    ray.get(a.shutdown.remote(), timeout=30)
                except Exception as err:  # noqa: BLE001 - keep tearing the rest down
                    logger.warning("%s: shutdown failed: %s", e.engine_id, err)
                ray.kill(a)
        if self.router is not None:
            self.router.stop()
