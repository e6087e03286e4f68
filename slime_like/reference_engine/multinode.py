"""Multi-node engines: TP ranks on other nodes join node 0 through `--dist-init-addr`.

`--nnodes N --node-rank R --dist-init-addr HOST:PORT` starts one process per node, as
sglang does. Node r runs TP ranks `r*k .. r*k+k-1` (k = tp_size / nnodes). Node 0 serves
HTTP and runs rank 0 in its own process; every other rank is a child process of its node's
process. All ranks form one gloo default group whose store is node 0's `HOST:PORT`; ranks
on other nodes reach node 0's rank driver at `HOST:PORT+1` (a `multiprocessing.connection`
listener with an HMAC handshake), so weight operations fan out to them exactly as to local
ranks, and a weight group places every rank at `rank_offset + tp_rank`.

Each non-zero node's process sends node 0 a heartbeat. Node 0 exits non-zero when a node's
heartbeat connection breaks (its process died) or stays silent past
`SLIME_LIKE_REFERENCE_NODE_TIMEOUT` seconds (default 10): like a crashed sglang
scheduler, a lost rank takes the whole engine down so the orchestrator recovers it. A
non-zero node exits non-zero when node 0 goes away or one of its ranks dies, and 0 when
node 0 shut the engine down.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener

from slime_like.errors import LaunchError
from slime_like.reference_engine.args import EngineArgs, split_host_port

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "SLIME_LIKE_REFERENCE_AUTHKEY"
NODE_TIMEOUT_ENV = "SLIME_LIKE_REFERENCE_NODE_TIMEOUT"
_DEFAULT_AUTHKEY = "slime_like-reference-engine"
_HEARTBEAT_S = 0.5
_CONNECT_RETRY_S = 0.2


def authkey() -> bytes:
    """The HMAC key of node 0's rank driver (same on every node; set it on shared networks)."""
    return os.environ.get(AUTHKEY_ENV, _DEFAULT_AUTHKEY).encode()


def node_timeout() -> float:
    """Seconds of heartbeat silence after which node 0 declares a node lost."""
    return float(os.environ.get(NODE_TIMEOUT_ENV, "10"))


def store_address(args: EngineArgs) -> tuple[str, int]:
    """Node 0's gloo store: the dist-init address itself."""
    return split_host_port(args.dist_init_addr)


def driver_address(args: EngineArgs) -> tuple[str, int]:
    """Node 0's rank driver: the port after the dist-init port (inside sglang's block)."""
    host, port = store_address(args)
    return host, port + 1


def connect_to_node0(args: EngineArgs, hello: tuple, deadline: float) -> Connection:
    """Dial node 0's rank driver until it listens (node 0 may start later), then say hello."""
    address = driver_address(args)
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            conn = Client(address, authkey=authkey())
            conn.send(hello)
            return conn
        except (ConnectionRefusedError, ConnectionResetError, OSError) as e:
            last = e
            time.sleep(_CONNECT_RETRY_S)
    raise LaunchError(f"could not reach node 0's rank driver at {address[0]}:{address[1]} "
                      f"(--dist-init-addr {args.dist_init_addr} + 1): {last}")


class RankDriver:
    """Node 0: accepts the connections of remote TP ranks and of other nodes' heartbeats."""

    def __init__(self, args: EngineArgs):
        self.args = args
        host, port = driver_address(args)
        self._listener = Listener((host, port), authkey=authkey())
        self._cv = threading.Condition()
        self.ranks: dict[int, Connection] = {}
        self.nodes: dict[int, Connection] = {}
        self._closed = False
        threading.Thread(target=self._accept_loop, name="rank-driver", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - a failed handshake or the listener closing
                if self._closed:
                    return
                logger.warning("rank driver: refused a connection (bad authkey or protocol)")
                continue
            if not conn.poll(10):
                conn.close()
                continue
            kind, index = conn.recv()
            with self._cv:
                (self.ranks if kind == "rank" else self.nodes)[int(index)] = conn
                self._cv.notify_all()

    def _node_gone(self, node: int) -> bool:
        """True when the node's heartbeat connection closed (its process exited)."""
        conn = self.nodes.get(node)
        try:
            while conn is not None and conn.poll(0):
                conn.recv()
        except (EOFError, OSError):
            return True
        return False

    def wait_rank(self, rank: int, deadline: float) -> Connection:
        """The connection of remote TP rank `rank`, once it dialled in."""
        node = rank // self.args.ranks_per_node
        with self._cv:
            while rank not in self.ranks:
                if self._node_gone(node):
                    raise LaunchError(f"node {node} exited before its TP rank {rank} joined")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LaunchError(
                        f"TP rank {rank} (node {rank // self.args.ranks_per_node}) never joined through "
                        f"--dist-init-addr {self.args.dist_init_addr}; is that node's process running?")
                self._cv.wait(min(left, 1.0))
            return self.ranks[rank]

    def wait_nodes(self, deadline: float) -> dict[int, Connection]:
        """Every other node's heartbeat connection."""
        wanted = set(range(1, self.args.nnodes))
        with self._cv:
            while not wanted <= set(self.nodes):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(wanted - set(self.nodes))
                    raise LaunchError(f"nodes {missing} sent no heartbeat to node 0")
                self._cv.wait(min(left, 1.0))
            return dict(self.nodes)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self._listener.close()


class NodeWatch:
    """Node 0: a node whose heartbeat breaks or goes silent is lost (`on_lost` is called once)."""

    def __init__(self, nodes: dict[int, Connection], on_lost: Callable[[str], None]):
        self.nodes = nodes
        self.on_lost = on_lost
        self.stopping = False
        threading.Thread(target=self._run, name="node-watch", daemon=True).start()

    def _run(self) -> None:
        timeout = node_timeout()
        last_seen = {n: time.monotonic() for n in self.nodes}
        while not self.stopping:
            for node, conn in self.nodes.items():
                try:
                    while conn.poll(0):
                        conn.recv()
                        last_seen[node] = time.monotonic()
                except (EOFError, OSError):
                    if not self.stopping:
                        self.on_lost(f"node {node}'s process went away (its connection closed)")
                    return
                if time.monotonic() - last_seen[node] > timeout:
                    if not self.stopping:
                        self.on_lost(f"node {node} sent no heartbeat for {timeout:g}s ({NODE_TIMEOUT_ENV})")
                    return
            time.sleep(0.1)

    def shutdown(self) -> None:
        """Tell every node the engine is shutting down (they exit 0)."""
        self.stopping = True
        for conn in self.nodes.values():
            with contextlib.suppress(Exception):
                conn.send(("shutdown",))


def serve_node(args: EngineArgs, rank_main: Callable[..., None]) -> int:
    """The process of node `args.node_rank` > 0: run its TP ranks, heartbeat to node 0.

    `rank_main(rank, args, None)` is a TP rank's entry point (`tp.rank_main`). Returns 0
    when node 0 shut the engine down (or on SIGTERM), 1 when node 0 went away or a local
    rank died.
    """
    ctx = mp.get_context("spawn")
    procs: list[mp.Process] = []
    for rank in args.node_ranks():
        proc = ctx.Process(target=rank_main, args=(rank, args, None), name=f"reference-tp{rank}",
                           daemon=True)
        proc.start()
        procs.append(proc)

    def stop_children() -> None:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        deadline = time.monotonic() + float(os.environ.get("SLIME_LIKE_REFERENCE_READY_TIMEOUT", "300"))
        beat = connect_to_node0(args, ("node", args.node_rank), deadline)
    except LaunchError as e:
        logger.error("node %d: %s", args.node_rank, e)
        stop_children()
        return 1
    logger.info("node %d of %d: TP ranks %s joined node 0 at %s", args.node_rank, args.nnodes,
                list(args.node_ranks()), args.dist_init_addr)
    while not stop.is_set():
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            logger.error("node %d: TP rank process %s exited with code %s; leaving the engine",
                         args.node_rank, dead[0].name, dead[0].exitcode)
            stop_children()
            return 1
        try:
            beat.send(("ping", time.time()))
            if beat.poll(_HEARTBEAT_S):
                message = beat.recv()
                if message and message[0] == "shutdown":
                    logger.info("node %d: node 0 shut the engine down", args.node_rank)
                    for p in procs:
                        p.join(timeout=10)
                    stop_children()
                    return 0
        except (EOFError, OSError) as e:
            logger.error("node %d: lost node 0 (%s); exiting", args.node_rank, e)
            stop_children()
            return 1
    stop_children()
    return 0
