"""How one engine comes and goes: launch, attach, loaded, probe, kill, shutdown.

Our engines are `EngineActor`s (one per node of the engine) on their placement bundles;
an external engine (someone else's server, `--rollout-external-engine-addrs`) is attached
by address, checked against the job's flags and never killed. The launcher holds no
lifecycle state: the fleet moves the engine, the launcher does what each move needs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from slime_like.cluster.placement import JobPlacement
from slime_like.config.fleet_slices import FleetSettings
from slime_like.config.layout import EnginePlacement
from slime_like.engine.actor import EngineActor
from slime_like.engine.address import EngineAddress
from slime_like.engine.external import CHECKED_FIELDS, ExternalEngine
from slime_like.engine.from_placement import engine_config
from slime_like.engine.session import EngineSession
from slime_like.errors import FleetError
from slime_like.fleet.lifecycle import PING_ONLY, ManagedEngine
from slime_like.protocol.weight_version import parse_weight_version

logger = logging.getLogger(__name__)
# How long a liveness round waits for the engine actors' answers (an actor on a node cut
# off from the network answers nothing until its link returns).
LIVENESS_TIMEOUT_S = 10.0


class Launcher:
    """Starts, attaches, watches, probes and stops the engines of one fleet."""

    def __init__(self, settings: FleetSettings, placement: JobPlacement, log_dir: Path):
        self.settings = settings
        self.placement = placement
        self.log_dir = log_dir
        self.closing = False

    def model_path(self, p: EnginePlacement) -> str:
        return self.settings.model_paths.get(p.model_name) or p.model_path or ""

    # ---- coming up ---------------------------------------------------------------------------

    def launch(self, e: ManagedEngine) -> Any:
        """Create the engine's node actors and start their servers; an ObjectRef of the URL.
        Refused once the fleet shuts down (a relaunch then would outlive it)."""
        if self.closing:
            raise FleetError(f"{e.engine_id}: not launched: the fleet is shutting down")
        e.actors = [EngineActor.options(**self.placement.engine_options(p)).remote(
            engine_config(p, self.settings.engine, model_path=self.model_path(p),
                          log_dir=str(self.log_dir))) for p in e.placements]
        dist_init = None
        if len(e.actors) > 1:
            dist_init = ray.get(e.actors[0].reserve_dist_init_addr.remote())
        refs = [a.init.remote(dist_init) for a in e.actors]
        return refs[0]

    @staticmethod
    def wait_launched(launching: Any, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait for `launch`'s answer: the server is healthy and generated once (True), or
        `stop()` turned true first (False: a relaunch the fleet's end overtook)."""
        while not ray.wait([launching], timeout=0.5)[0]:
            if stop():
                return False
        ray.get(launching)
        return True

    def loaded(self, e: ManagedEngine) -> dict:
        """Our engine is serving: its handle and the version it loaded (the LOADED details)."""
        e.handle = ray.get(e.actors[0].handle.remote(e.tp_size))
        e.verified_version = parse_weight_version(e.handle.weight_version())
        return {"url": e.handle.url, "pid": ray.get(e.actors[0].server_pid.remote()),
                "version": str(e.verified_version)}

    def attach(self, e: ManagedEngine) -> dict:
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
        e.handle = EngineSession(EngineAddress(
            url, e.tp_size, api_key=eng.api_key, admin_api_key=eng.admin_api_key,
            engine_id=e.engine_id, worker_type=ext.config.worker_type,
            bootstrap_port=ext.bootstrap_port))
        e.handle.health_generate(timeout=30.0)
        e.verified_version = parse_weight_version(e.handle.weight_version())
        return {"url": url, "version": str(e.verified_version), "external": True}

    def reattach(self, e: ManagedEngine, wait_s: float) -> dict | None:
        """Poll a dead external engine's address until it is back (its `attach` details), or
        None if the fleet closes meanwhile; FleetError after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.attach(e)
            except Exception as err:  # noqa: BLE001 - not back yet (refused, warming up, ...)
                if self.closing:
                    return None
                if time.monotonic() >= deadline:
                    raise FleetError(f"{e.engine_id}: not back at {e.external_address} after "
                                     f"{wait_s:g}s (--external-engine-reconnect-timeout): "
                                     f"{err}") from err
                time.sleep(0.5)

    # ---- is it there ---------------------------------------------------------------------------

    def alive(self, e: ManagedEngine) -> bool:
        """Whether every server process of the engine runs (an external one: answers /ping)."""
        if e.external_address is not None:
            return e.handle is not None and e.handle.ping(timeout=2.0)
        return self.alive_all([e])[e.engine_id]

    def alive_all(self, engines: list[ManagedEngine]) -> dict[str, bool]:
        """`alive` for many engines in one round trip: every actor is asked at once, so a
        health round costs the same wall time at 64 engines as at 4."""
        found: dict[str, bool] = {}
        asked: dict[Any, str] = {}
        for e in engines:
            if e.external_address is not None:
                found[e.engine_id] = self.alive(e)
                continue
            found[e.engine_id] = True
            for a in e.actors:
                try:
                    asked[a.is_alive.remote()] = e.engine_id
                except Exception:  # noqa: BLE001 - an actor that cannot be asked is not alive
                    found[e.engine_id] = False
        if not asked:
            return found
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=LIVENESS_TIMEOUT_S)
        # No answer in time, or an actor Ray calls unavailable, is not an exit: a node cut
        # off from the network keeps its processes and answers again when its link returns.
        # The probes decide, as for a hang (SUSPECT at once, DEAD after
        # --rollout-health-check-failures); a node Ray declares dead fails with ActorDiedError.
        for ref in ready:
            try:
                answer = bool(ray.get(ref))
            except ray.exceptions.ActorUnavailableError:
                answer = True
            except Exception:  # noqa: BLE001 - an actor that died is not alive
                answer = False
            found[asked[ref]] = found[asked[ref]] and answer
        return found

    def answers(self, e: ManagedEngine, timeout: float = 1.0) -> bool:
        """Whether the engine answers `/ping` within `timeout`."""
        try:
            return e.handle is not None and e.handle.ping(timeout=timeout)
        except Exception:  # noqa: BLE001 - not answering is the finding
            return False

    def probe(self, e: ManagedEngine, timeout: float) -> None:
        """A real generation step; while paused for an update (where /health_generate
        blocks by design), released, or held idle for the sync that follows (no request
        may run on it before that sync), only that the server still answers (/ping), so a
        hang during a sync is still found."""
        if e.phase in PING_ONLY:
            if not e.handle.ping(timeout=timeout):
                raise FleetError(f"{e.engine_id}: /ping unanswered while {e.state.value}")
            return
        e.handle.health_generate(timeout=timeout)

    # ---- going away ---------------------------------------------------------------------------

    def kill(self, e: ManagedEngine) -> None:
        """Kill what is left of a dead engine (before its relaunch): no grace, actors gone."""
        for a in e.actors:
            with contextlib.suppress(Exception):  # the actor may have died with its server
                ray.get(a.shutdown.remote(1.0), timeout=30)  # dead or hung: no grace
            ray.kill(a)

    def shutdown(self, engines: list[ManagedEngine], timeout_s: float = 30.0) -> None:
        """Stop the engines' servers and actors (the fleet unrouted them first), all at
        once: a fleet's end takes one engine's stop, not one per engine."""
        asked: dict[Any, ManagedEngine] = {}
        for e in engines:
            for a in e.actors:
                try:
                    asked[a.shutdown.remote()] = e
                except Exception as err:  # noqa: BLE001 - keep tearing the rest down
                    logger.warning("%s: shutdown failed: %s", e.engine_id, err)
        ready, late = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s) \
            if asked else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as err:  # noqa: BLE001 - keep tearing the rest down
                logger.warning("%s: shutdown failed: %s", asked[ref].engine_id, err)
        for ref in late:
            logger.warning("%s: no answer to its shutdown in %.0fs: its actor is killed",
                           asked[ref].engine_id, timeout_s)
        for e in engines:
            for a in e.actors:
                with contextlib.suppress(Exception):  # gone already
                    ray.kill(a)

    def close(self) -> None:
        """The fleet is shutting down: a reattach in progress gives up."""
        self.closing = True
