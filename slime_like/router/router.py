"""Router: one router process (sglang-router or smg, each from its own Python package;
`kinds.py`), started and stopped cleanly.

Its HTTP and Prometheus ports are reserved on this node until the router binds them; the
start waits on `/liveness` with a deadline (no fixed sleep) while watching the process, and
a start that loses a port race (a port taken between our release and its bind) is retried
with new ports a bounded number of times.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime_like.cluster.hosts import node_ip, server_url
from slime_like.cluster.ports import reserve_ports
from slime_like.cluster.process import ServerProcess, server_env
from slime_like.engine.rl_plane import RlPlane
from slime_like.errors import LaunchError
from slime_like.router.args import compose_router_args, render_router_argv
from slime_like.router.client import RouterClient
from slime_like.router.kinds import SMG, RouterKind, router_kind

logger = logging.getLogger(__name__)


def installed_router_version(kind: str | RouterKind | None = None) -> str:
    """The installed version of a router (default: sglang-router), from its distribution."""
    return router_kind(kind).installed_version()


def check_router_version(kind: str | RouterKind | None = None) -> str:
    """Refuse a router whose worker API we do not speak (sglang-router: UUID worker ids came
    in 0.3.0)."""
    return router_kind(kind).check_version()


class Router:
    """A router process we own (see `RouterClient` for one we only talk to).

    `kind`: "sglang-router" (the default) or "smg"; `version` is read from its distribution
    when it starts.
    """

    def __init__(self, *, host: str | None = None, pd_disaggregation: bool = False,
                 router_flags: Mapping[str, Any] | None = None, log_dir: str | Path | None = None,
                 api_key: str | None = None, startup_timeout: float = 60.0,
                 port_attempts: int = 3, python: str = sys.executable, name: str = "router",
                 port: int | None = None, kind: str | RouterKind | None = None):
        self.kind = router_kind(kind)
        self.version: str | None = None
        self.host = host or node_ip()
        self.fixed_port = port  # --sglang-router-port: bind exactly there (no other attempt)
        self.pd_disaggregation = pd_disaggregation
        self.router_flags = dict(router_flags or {})
        if api_key:
            self.router_flags.setdefault("api_key", api_key)
        self.api_key = self.router_flags.get("api_key")
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="slime_like_router_"))
        self.startup_timeout = startup_timeout
        self.port_attempts = port_attempts
        self.python = python
        self.name = name
        self.port: int | None = None
        self.prometheus_port: int | None = None
        self.process: ServerProcess | None = None
        self.warnings: list[str] = []

    @property
    def url(self) -> str:
        if self.port is None:
            raise LaunchError(f"{self.name}: not started")
        return server_url(self.host, self.port)

    @property
    def prometheus_url(self) -> str:
        if self.prometheus_port is None:
            raise LaunchError(f"{self.name}: not started")
        return server_url(self.host, self.prometheus_port) + "/metrics"

    @property
    def rl_plane(self) -> RlPlane | None:
        """smg's RL control plane (`/v1/rl`), when this is an smg started with `enable_rl`."""
        if self.kind.name != SMG or not self.router_flags.get("enable_rl") or self.port is None:
            return None
        return RlPlane(self.url, api_key=self.api_key)

    @property
    def client(self) -> RouterClient:
        return RouterClient(self.url, api_key=self.api_key, worker_fields=self.kind.worker_fields)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> Router:
        """Launch and wait until the router answers `/liveness`; LaunchError with its log if not."""
        if self.process is not None and self.process.is_alive():
            return self
        self.version = self.kind.check_version()
        last: LaunchError | None = None
        for attempt in range(1, self.port_attempts + 1):
            try:
                self._start_once()
                return self
            except LaunchError as e:
                if self.process is None or not self.process.exit_looks_like_address_in_use():
                    self.stop()
                    raise
                last = e
                logger.warning("%s: a port was taken before the router bound it (attempt %d/%d); "
                               "retrying with new ports", self.name, attempt, self.port_attempts)
                self.stop()
        raise LaunchError(f"{self.name}: lost the port race {self.port_attempts} times",
                          last.log_tail if last else "")

    def restart(self, timeout: float = 30.0) -> Router:
        """Relaunch a router that died on the ports it had, so clients keep their URL.

        The kernel may hold the port for a moment after the crash; the bind is retried
        until `timeout`, then new ports are taken (the caller reads `url` again).
        """
        if self.process is not None and self.process.is_alive():
            return self
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._launch()
                return self
            except LaunchError:
                if self.process is None or not self.process.exit_looks_like_address_in_use():
                    raise
                if time.monotonic() > deadline:
                    logger.warning("%s: port %s still taken after %.0fs; moving to new ports",
                                   self.name, self.port, timeout)
                    return self.start()
                time.sleep(0.5)

    def _start_once(self) -> None:
        if self.fixed_port is not None:
            with reserve_ports(1, host=self.host) as reservation:
                self.port, self.prometheus_port = self.fixed_port, reservation.ports[0]
                reservation.release_for_server()
                self._launch()
            return
        with reserve_ports(2, host=self.host) as reservation:
            self.port, self.prometheus_port = reservation.ports
            reservation.release_for_server()
            self._launch()

    def _launch(self) -> None:
        """Start the router on `self.port`/`self.prometheus_port` and wait until it is live."""
        composed = compose_router_args(host=self.host, port=self.port,
                                       prometheus_port=self.prometheus_port,
                                       pd_disaggregation=self.pd_disaggregation,
                                       router_flags=self.router_flags, kind=self.kind)
        self.warnings = composed.warnings
        for w in composed.warnings:
            logger.warning("%s: %s", self.name, w)
        self.process = ServerProcess(render_router_argv(composed.args, self.python, self.kind),
                                     log_path=self.log_path, name=self.name,
                                     env=server_env(local_hosts=[self.host]))
        self.process.start()
        client = self.client
        self.process.wait_healthy(client.is_live, self.startup_timeout, what="live")

    def stop(self, grace: float = 5.0) -> None:
        """Terminate the router process tree (idempotent)."""
        if self.process is not None:
            self.process.terminate(grace=grace)

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
