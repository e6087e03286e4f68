"""EngineActor: the Ray actor around `EngineServer`, one per engine per node.

All logic lives in `EngineServer` (constructible without Ray); this module only decides how the
actor runs. It is threaded (`max_concurrency`), so a health probe or `get_url` is never
queued behind a long weight update or a start-up wait, and a group's engines can be driven
concurrently without the one-call-at-a-time deadlocks slime hits with PP > 1; a caller
that parks `wait_down.remote(None)` learns of a server crash the moment it happens. The
caller gives resources and placement (placement group + bundle index) with `.options(...)`.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from slime_like.engine.server import EngineConfig, EngineServer

logger = logging.getLogger(__name__)

MAX_CONCURRENCY = 16


class _EngineActor(EngineServer):
    """EngineServer, plus what only makes sense across a Ray boundary."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)

    def node_ip(self) -> str:
        """The address this actor's node is reached at (IPv6 unbracketed)."""
        return self._node_host()

    def ping(self) -> bool:
        return True


EngineActor = ray.remote(max_concurrency=MAX_CONCURRENCY, num_cpus=0)(_EngineActor)


def crash_server(actor: Any, timeout: float | None = 30.0) -> None:
    """SIGKILL the server behind `actor` (chaos and demos) and return once it is dead.

    The actor is threaded, so the fleet's exit watcher can see the death and `ray.kill`
    the actor to relaunch the engine before this call's answer is sent: the answer is then
    lost, but the crash has landed. An actor that is gone means its server is gone too.
    """
    try:
        ray.get(actor.simulate_crash.remote(), timeout=timeout)
    except ray.exceptions.RayActorError as e:
        logger.info("engine actor gone while crashing its server (recovery took it): %s",
                    str(e).splitlines()[0])
