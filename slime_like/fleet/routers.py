"""Every model's router (sglang-router or smg): started, supervised, restarted on its port; membership.

`Routers` is the fleet's only way into a router: `add` and `remove` are the only calls
that change which engines a router sends traffic to (the fleet decides when). A router
that exits is relaunched at once on the same port; the fleet then re-adds the engines that
were in it (`on_restarted`), so clients holding the router's URL carry on.

With admission dispatch (`--rollout-dispatch admission`) the rollout client binds requests
to engines itself (`rollout/dispatch.py`); each model's `EngineSlots` is kept here, beside
the router, so it holds exactly the router's engines: an engine enters it after the router
lists it and leaves it before the router drops it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from slime_like.config.fleet_slices import FleetSettings
from slime_like.config.layout import RouterPlan
from slime_like.errors import ConfigError, RouterError
from slime_like.fleet.events import EventBus, RouterState
from slime_like.fleet.lifecycle import ManagedEngine
from slime_like.protocol.modes import Dispatch, WorkerType
from slime_like.rollout.dispatch import EngineSlots
from slime_like.router.router import Router

logger = logging.getLogger(__name__)

# How long a routed engine's registration waits for smg's RL plane to list it (smg learns
# the worker's engine label just after listing it under /workers).
RL_LISTED_TIMEOUT_S = 5.0


def subject(model: str) -> str:
    """How a router is named on the run's timeline."""
    return f"router/{model}"


class Routers(Mapping[str, Router]):
    """The routers of the job by model name; a read-only mapping to their `Router`s."""

    def __init__(self, settings: FleetSettings, plans: list[RouterPlan], updatable_model: str,
                 log_dir: Path, events: EventBus):
        self.settings = settings
        self.plans = plans
        self.updatable_model = updatable_model
        self.log_dir = log_dir
        self.events = events
        self.restarts: list[dict] = []
        self.closing = False
        # After a relaunch: the fleet re-adds that model's engines; how many it re-added.
        # (engines re-added at once, engines their sync in progress will route)
        self.on_restarted: Callable[[str], tuple[int, int]] = lambda model: (0, 0)
        self._routers: dict[str, Router] = {}
        self._state: dict[str, RouterState] = {}
        # Admission dispatch: each model's routed engines and their slots (rollout/dispatch.py)
        self.slots: dict[str, EngineSlots] = {}
        if settings.router.dispatch is Dispatch.ADMISSION:
            for plan in plans:
                if plan.pd_disaggregation:
                    raise ConfigError("--rollout-dispatch", f"admission binds each request to "
                                      f"one engine; model {plan.model_name!r} runs prefill and "
                                      "decode engines, which its router pairs: use router")
                self.slots[plan.model_name] = EngineSlots(
                    plan.model_name, queue=settings.router.dispatch_queue)

    # ---- the mapping -------------------------------------------------------------------------

    def __getitem__(self, model: str) -> Router:
        return self._routers[model]

    def __iter__(self) -> Iterator[str]:
        return iter(self._routers)

    def __len__(self) -> int:
        return len(self._routers)

    def url(self, model: str) -> str:
        return self._routers[model].url

    # ---- processes -----------------------------------------------------------------------------

    def start(self) -> None:
        """One router per model (the updatable model's on `--sglang-router-port` if set)."""
        for plan in self.plans:
            router = Router(kind=self.settings.router.kind,
                            pd_disaggregation=plan.pd_disaggregation,
                            router_flags=self.settings.router.flags, log_dir=self.log_dir,
                            api_key=self.settings.router.api_key,
                            name=f"router-{plan.model_name}",
                            port=self.settings.router_port
                            if plan.model_name == self.updatable_model else None).start()
            self._routers[plan.model_name] = router
            self._moved(plan.model_name, RouterState.READY, url=router.url,
                        metrics=router.prometheus_url, pid=router.process.pid,
                        router=f"{router.kind.name} {router.version}")
            self._supervise(plan.model_name, router)

    def _moved(self, model: str, state: RouterState, **details) -> None:
        previous = self._state.get(model)
        self._state[model] = state
        self.events.emit(subject(model), state, previous, **details)

    def _supervise(self, model: str, router: Router) -> None:
        """A router that dies is relaunched at once on its port, its workers re-added."""
        router.process.on_exit(lambda code: threading.Thread(
            target=self._restart, args=(model, router, code),
            name=f"restart-router-{model}", daemon=True).start())

    def _restart(self, model: str, router: Router, code: int) -> None:
        if self.closing:
            return
        t0 = time.time()
        self._moved(model, RouterState.DEAD, code=code)
        logger.warning("router of %s exited with code %s; relaunching on port %s", model, code,
                       router.port)
        try:
            router.restart()
        except Exception as err:  # noqa: BLE001 - without a router the run cannot go on
            logger.exception("router of %s could not be relaunched", model)
            self._moved(model, RouterState.FAILED, error=str(err))
            return
        workers, left_to_sync = self.on_restarted(model)
        took = round(time.time() - t0, 2)
        self.restarts.append({"model": model, "code": code, "restart_s": took,
                              "url": router.url, "at": t0})
        self._moved(model, RouterState.READY, url=router.url, pid=router.process.pid,
                    restart_s=took, workers=workers, left_to_sync=left_to_sync)
        self._supervise(model, router)

    def stop(self) -> None:
        self.closing = True
        for router in self._routers.values():
            router.stop()

    # ---- membership ------------------------------------------------------------------------------

    def add(self, e: ManagedEngine, timeout: float | None = None, *,
            if_answering: bool = False) -> None:
        """Make the engine a worker of its model's router (waits until the router lists it,
        up to `timeout`, by default the registration timeout).

        `if_answering`: register only an engine that answers /health within `timeout` now,
        for one that may have hung unseen. sglang-router cannot cancel a registration it is
        still probing: given up on, it would land whenever the engine answered again, at
        whatever weights it then had.
        """
        if e.router_worker_id is not None or e.handle is None:
            return  # a worker of it already
        h = e.handle
        if h.worker_type == WorkerType.ENCODER:
            return
        wait = self.settings.register_timeout_s if timeout is None else \
            min(timeout, self.settings.register_timeout_s)
        if if_answering:
            try:
                h.health_generate(timeout=wait)
            except Exception as err:  # noqa: BLE001 - any failure: not registered
                raise RouterError(f"{e.engine_id} ({h.url}) did not answer /health within "
                                  f"{wait:.0f}s: not registered ({err})") from err
        router = self._routers[e.model_name]
        # The router calls the worker with the key it was registered with: an engine with
        # no user key (`--router-enable-rl`) is registered with its admin key, which its
        # info routes accept too, so smg's RL plane reaches its admin routes.
        info = router.client.add_worker(
            h.url, worker_type=h.worker_type, bootstrap_port=h.bootstrap_port,
            api_key=h.api_key or h.admin_api_key, timeout=wait)
        e.router_worker_id = info.id
        if router.rl_plane is not None and h.api_key is None:
            # Through the plane once it reaches the engine (else each step calls it directly).
            if router.rl_plane.wait_listed(h.url, min(wait, RL_LISTED_TIMEOUT_S)):
                h.rl_plane = router.rl_plane
            else:
                logger.warning("%s: routed, but smg's RL plane does not list it after %.0fs; "
                               "its syncs call it directly", e.engine_id, RL_LISTED_TIMEOUT_S)
        slots = self.slots.get(e.model_name)
        if slots is not None:
            known = slots.knows(e.engine_id, h.url)
            slots.route(e.engine_id, h.url, h.api_key, None if known else self._slots_of(e))

    def _slots_of(self, e: ManagedEngine) -> int:
        """The engine's running-request slots: its `max_running_requests` (`/v1/loads`,
        summed over DP ranks), else `--sglang-server-concurrency`."""
        try:
            loads = e.handle.loads(timeout=10.0).get("loads") or []
            slots = sum(int(x["max_running_requests"]) for x in loads)
            if slots > 0:
                return slots
        except Exception as err:  # noqa: BLE001 - any failure: the configured concurrency
            logger.warning("%s: no max_running_requests from /v1/loads (%s)", e.engine_id, err)
        return self.settings.engine.server_concurrency

    def remove(self, e: ManagedEngine) -> None:
        """Take the engine out of its router; a router that is down took it with it."""
        if e.router_worker_id is None or e.handle is None:
            return
        slots = self.slots.get(e.model_name)
        if slots is not None:
            slots.unroute(e.engine_id)  # before the router: no request bound to it from now
        client = self._routers[e.model_name].client
        try:  # by the id we hold, and the URL under any other (the id may be stale)
            client.remove_worker(e.router_worker_id, url=e.handle.url, timeout=15)
        except Exception as err:  # noqa: BLE001 - a dead router takes its workers with it
            logger.warning("%s: removal from the router failed: %s", e.engine_id, err)
        e.router_worker_id = None

    def forget(self, e: ManagedEngine) -> None:
        """The router was relaunched without the engine: it is no worker of it any more."""
        slots = self.slots.get(e.model_name)
        if slots is not None:
            slots.unroute(e.engine_id)
        e.router_worker_id = None
