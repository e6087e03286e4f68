"""EngineServer: one engine's server process on one node (EngineActor wraps it for Ray).

`init` reads this node's IP, reserves the server's ports here and holds them until the
server binds them, composes the server args, starts the server and waits until it is
healthy and can generate. It owns the process and nothing else: talking to the engine is
the `EngineSession`'s job (`handle()` builds it, with the engine's keys), and router
membership is the fleet's. On nodes other than node 0 of a multi-node engine (which serve
no HTTP) `handle()` is None.
"""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slime_like.cluster.hosts import format_host, node_ip, server_url
from slime_like.cluster.ports import DEFAULT_PORT_RANGE, PortReservation, reserve_ports
from slime_like.cluster.process import ServerProcess, server_env
from slime_like.engine.address import EngineAddress
from slime_like.engine.client import EngineClient
from slime_like.engine.launch import compose_server_args, forced_server_args, render_argv
from slime_like.engine.session import EngineSession
from slime_like.errors import ConfigError, EngineError, LaunchError
from slime_like.protocol.compat import EngineFeatures
from slime_like.protocol.flag_tables import ComposedArgs
from slime_like.protocol.modes import WorkerType

logger = logging.getLogger(__name__)



@dataclass
class EngineConfig:
    """What one engine actor needs, as plain values (from the placement and the config)."""

    model_path: str
    program: Literal["sglang", "reference"] = "sglang"
    worker_type: WorkerType = WorkerType.REGULAR
    num_gpus_per_engine: int = 1
    pp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    engine_rank: int = 0
    seed: int = 1234
    enable_memory_saver: bool = False
    sglang_flags: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    overrides_path: str = "overrides"
    api_key: str | None = None
    admin_api_key: str | None = None
    host: str | None = None  # this node's address; read from Ray/the kernel when None
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    startup_timeout: float = 600.0
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE
    port_attempts: int = 3
    python: str = sys.executable
    name: str | None = None

    def __post_init__(self) -> None:
        self.worker_type = WorkerType(self.worker_type)  # a word from a caller: its member

    @property
    def label(self) -> str:
        return self.name or f"engine{self.engine_rank}" + (f"-node{self.node_rank}" if self.nnodes > 1 else "")


class EngineServer:
    """One engine's server process on this node: ports, args, process, readiness."""

    # Ports slime reserves for sglang's dist-init block (sglang derives ~6 + dp ports from it).
    DIST_INIT_BLOCK = 30

    def __init__(self, config: EngineConfig,
                 reserve: Callable[..., PortReservation] = reserve_ports):
        if config.nnodes > 1 and config.worker_type == WorkerType.ENCODER:
            raise ConfigError("worker_type", "an encoder engine cannot span nodes")
        self.config = config
        self._reserve = reserve  # tests replace it to lose the port race on purpose
        self.host: str | None = None
        self.port: int | None = None
        self.nccl_port: int | None = None
        self.bootstrap_port: int | None = None
        self.dist_init_addr: str | None = None
        self.process: ServerProcess | None = None
        self.server_args: dict[str, Any] = {}
        self.warnings: list[str] = []
        self._dist_reservation: PortReservation | None = None
        # Lock files of the server's ports stay held for its whole life: sglang binds some of
        # them (nccl, dist-init block) only later, and no other engine on this node may take
        # them meanwhile.
        self._reservation: PortReservation | None = None
        self._client: EngineClient | None = None
        self.features: EngineFeatures | None = None  # read from /server_info once serving

    # ---- addresses -------------------------------------------------------------------------

    def _node_host(self) -> str:
        if self.host is None:
            self.host = (self.config.host or node_ip()).strip("[]")
        return self.host

    def get_url(self) -> str | None:
        """`http://host:port` of the server (IPv6 bracketed); None on nodes other than node 0."""
        if self.config.node_rank != 0 or self.port is None:
            return None
        return server_url(self._node_host(), self.port)

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            url = self.get_url()
            if url is None:
                raise LaunchError(f"{self.config.label}: not started, or not node 0 (no HTTP here)")
            self._client = EngineClient(url, api_key=self.config.api_key,
                                        admin_api_key=self.config.admin_api_key)
        return self._client

    def reserve_dist_init_addr(self) -> str:
        """On node 0 of an engine: reserve the dist-init port block here; `host:port` for
        every node's `init`. Held (as lock files once the server starts) until shutdown."""
        if self._dist_reservation is None:
            self._dist_reservation = self._reserve(
                1, consecutive=self.DIST_INIT_BLOCK + self.config.dp_size,
                host=self._node_host(), port_range=self.config.port_range)
            self.dist_init_addr = f"{format_host(self._node_host())}:{self._dist_reservation.ports[0]}"
        return self.dist_init_addr

    # ---- launch ----------------------------------------------------------------------------

    def init(self, dist_init_addr: str | None = None) -> str | None:
        """Start the server and wait until it is healthy; its URL (None off node 0).

        A start that fails because a port was taken before the server bound it is retried
        with new ports, `port_attempts` times in all; any other failure raises LaunchError
        with the server's log tail at once.
        """
        cfg = self.config
        if self.process is not None and self.process.is_alive():
            return self.get_url()
        if cfg.nnodes > 1 and dist_init_addr is None and cfg.node_rank != 0:
            raise ConfigError("dist_init_addr", f"{cfg.label}: node {cfg.node_rank} of a "
                              f"{cfg.nnodes}-node engine needs node 0's dist_init_addr")
        if dist_init_addr is None and cfg.nnodes > 1:
            dist_init_addr = self.reserve_dist_init_addr()
        self.dist_init_addr = dist_init_addr
        last: LaunchError | None = None
        for attempt in range(1, cfg.port_attempts + 1):
            try:
                self._start_once()
                break
            except LaunchError as e:
                lost_race = self.process is not None and self.process.exit_looks_like_address_in_use()
                if not lost_race:
                    self._stop_process()
                    raise
                # Other nodes already know the dist-init address: keep it, change the rest.
                if self.process is not None:
                    self.process.terminate(grace=5)
                last = e
                logger.warning("%s: a port was taken before the server bound it (attempt %d/%d)",
                               cfg.label, attempt, cfg.port_attempts)
            except BaseException:
                self._stop_process()  # nothing half started is left behind, whatever failed
                raise
        else:
            self._stop_process()
            raise LaunchError(f"{cfg.label}: every one of {cfg.port_attempts} attempts lost a port "
                              "to another process before the server bound it",
                              last.log_tail if last else "")
        return self.get_url()

    def compose_args(self, *, host: str, port: int, nccl_port: int | None = None,
                     bootstrap_port: int | None = None) -> ComposedArgs:
        """This engine's server args for the given address (pure: no ports are touched)."""
        cfg = self.config
        forced = forced_server_args(
            model_path=cfg.model_path, host=host, port=port, nccl_port=nccl_port,
            num_gpus_per_engine=cfg.num_gpus_per_engine, pp_size=cfg.pp_size,
            dp_size=cfg.dp_size, ep_size=cfg.ep_size, nnodes=cfg.nnodes,
            node_rank=cfg.node_rank, dist_init_addr=self.dist_init_addr,
            base_gpu_id=cfg.base_gpu_id, gpu_id_step=cfg.gpu_id_step, seed=cfg.seed,
            engine_rank=cfg.engine_rank, enable_memory_saver=cfg.enable_memory_saver,
            api_key=cfg.api_key, admin_api_key=cfg.admin_api_key,
            disaggregation_bootstrap_port=bootstrap_port)
        return compose_server_args(forced=forced, sglang_flags=cfg.sglang_flags,
                                   overrides=cfg.overrides, worker_type=cfg.worker_type,
                                   overrides_path=cfg.overrides_path)

    def _start_once(self) -> None:
        cfg = self.config
        host = self._node_host()
        prefill = cfg.worker_type == WorkerType.PREFILL
        reservation = self._reserve(3 if prefill else 2, host=host, port_range=cfg.port_range)
        self._reservation = reservation
        try:
            ports = reservation.ports
            self.port, self.nccl_port = ports[0], ports[1]
            self.bootstrap_port = ports[2] if prefill else None
            self._client = None
            composed = self.compose_args(host=host, port=self.port, nccl_port=self.nccl_port,
                                         bootstrap_port=self.bootstrap_port)
            self.server_args, self.warnings = composed.args, composed.warnings
            # An override may move the port; the server's URL is wherever it was told to bind.
            self.port = int(composed.args["port"])
            self.bootstrap_port = composed.args.get("disaggregation_bootstrap_port")
            for w in composed.warnings:
                logger.warning("%s: %s", cfg.label, w)
            log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="slime_like_engines_"))
            self.process = ServerProcess(
                render_argv(composed.args, cfg.program, cfg.python),
                log_path=log_dir / f"{cfg.label}.log", name=cfg.label,
                env=server_env(extra=cfg.env, local_hosts=[host]))
            reservation.release_for_server()
            if self._dist_reservation is not None:
                self._dist_reservation.release_for_server()
            self.process.start()
            if cfg.node_rank == 0:
                self._wait_serving()
        except BaseException:
            reservation.handed_over()
            self._reservation = None
            raise

    def _wait_serving(self) -> None:
        """Healthy (`/health`), then one real generation (`/health_generate`), within the deadline."""
        assert self.process is not None
        t0 = time.monotonic()
        client = self.client
        self.process.wait_healthy(lambda: client.health(timeout=2.0), self.config.startup_timeout)
        left = max(5.0, self.config.startup_timeout - (time.monotonic() - t0))
        try:
            client.health_generate(timeout=left)
        except EngineError as e:
            if not self.process.is_alive():
                raise LaunchError(f"{self.config.label}: server exited during its first generation",
                                  self.process.log_tail()) from e
            raise LaunchError(f"{self.config.label}: healthy but cannot generate: {e}",
                              self.process.log_tail()) from e
        self.features = EngineFeatures.from_server_info(client.server_info())

    # ---- process ---------------------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def wait_exit(self, timeout: float | None = None) -> int | None:
        """Block until the server exits; its return code (None while still running)."""
        return self.process.wait_exit(timeout) if self.process else None

    def wait_down(self, timeout: float | None = None) -> str | None:
        """Block until the server is down (exited, or every thread of it exiting); how it
        went down, or None while it runs (`ServerProcess.wait_down`)."""
        return self.process.wait_down(timeout) if self.process else None

    def server_pid(self) -> int | None:
        return self.process.pid if self.process else None

    def log_tail(self, max_bytes: int = 6000) -> str:
        return self.process.log_tail(max_bytes) if self.process else ""

    def _release_ports(self) -> None:
        for r in (self._reservation, self._dist_reservation):
            if r is not None:
                r.handed_over()
        self._reservation = self._dist_reservation = None

    def _stop_process(self, grace: float = 10.0) -> None:
        if self.process is not None:
            self.process.terminate(grace=grace)
        self._release_ports()

    def shutdown(self, grace: float = 10.0) -> None:
        """Kill the server's whole process tree (idempotent); the fleet unroutes it first."""
        self._stop_process(grace)

    def suspend(self) -> None:
        """SIGSTOP the server tree: a hang (it stops answering but does not exit)."""
        if self.process is not None:
            self.process.kill(signal.SIGSTOP)

    def simulate_crash(self) -> None:
        """SIGKILL the server tree without telling anyone, as a real crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait_exit(10)

    def handle(self, tp_size: int | None = None) -> EngineSession | None:
        """The handle every other layer uses to talk to this engine (None off node 0)."""
        url = self.get_url()
        if url is None:
            return None
        cfg = self.config
        return EngineSession(EngineAddress(
            url, tp_size or max(1, cfg.num_gpus_per_engine // cfg.pp_size),
            api_key=cfg.api_key, admin_api_key=cfg.admin_api_key,
            engine_id=cfg.name or cfg.label, worker_type=cfg.worker_type,
            bootstrap_port=self.bootstrap_port))

    def describe(self) -> Mapping[str, Any]:
        """Where this engine runs and with what args (for logs, reports and tests)."""
        return {"label": self.config.label, "url": self.get_url(), "host": self.host,
                "port": self.port, "nccl_port": self.nccl_port,
                "bootstrap_port": self.bootstrap_port, "dist_init_addr": self.dist_init_addr,
                "server_pid": self.server_pid(), "worker_type": self.config.worker_type,
                "node_rank": self.config.node_rank, "warnings": list(self.warnings),
                "sglang_version": ".".join(map(str, self.features.version)) if self.features else None,
                "log_path": str(self.process.log_path) if self.process else None}
