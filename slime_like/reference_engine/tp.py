"""TP ranks: rank 0 is the HTTP process, ranks 1..N-1 are child processes holding full weights.

Generation runs on rank 0; every rank holds a full (replicated) copy of the weights and
takes part in weight updates, so a weight group has the layout of a real TP engine
(rank = rank_offset + tp_rank). The ranks form a gloo default process group, as sglang's
schedulers do (its weight-sync code asserts torch.distributed is initialised). Rank
processes die with their parent (PR_SET_PDEATHSIG plus a parent watch) and are killed on
shutdown. With `--nnodes > 1` the ranks of other nodes are children of those nodes'
processes and reach rank 0 over the network (`multinode.py`); rank 0 drives them through
the same send/recv interface as its local pipes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from slime_like.errors import LaunchError
from slime_like.protocol.weight_group import host_store
from slime_like.reference_engine.args import EngineArgs, split_host_port
from slime_like.reference_engine.rank_ops import RankOp

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_READY_TIMEOUT_S = 300.0
RANK_TIMEOUT_S = 3600.0  # how long an operation may take on another rank


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits, and watch it as well."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        # prctl fires on the death of the parent *thread*; the watch covers re-parenting too.
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def default_group_init_method(args: EngineArgs, local_port: int | None = None) -> str:
    """Where the TP ranks' gloo default group meets: node 0's dist-init address across nodes,
    a free loopback port on one node."""
    if args.nnodes > 1:
        host, port = split_host_port(args.dist_init_addr)
        return f"tcp://{host}:{port}"
    return f"tcp://127.0.0.1:{local_port}"


def rank_main(rank: int, args: EngineArgs, init_method: str | None, conn=None) -> None:
    """Entry point of TP rank `rank` >= 1: load the model, join the group, run the rank
    operations rank 0 sends (`rank_ops`), one at a time.

    `conn` is the pipe to rank 0 on node 0; a rank on another node (conn None) dials node
    0's rank driver instead and meets the others at the dist-init address.
    """
    die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"[tp{rank}] %(levelname)s %(message)s")
    if conn is None:
        from slime_like.reference_engine.multinode import connect_to_node0

        try:
            conn = connect_to_node0(args, ("rank", rank), time.monotonic() + _READY_TIMEOUT_S)
        except LaunchError as e:
            logger.error("TP rank %d: %s", rank, e)
            sys.exit(1)
        init_method = default_group_init_method(args)
    try:
        torch.set_num_threads(1)  # ranks only receive weights; leave the cores to rank 0
        from slime_like.models.config import ModelConfig
        from slime_like.models.loading import load_pretrained
        from slime_like.reference_engine.weight_receiver import WeightReceiver

        device = torch.device(args.rank_device(rank))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        config = ModelConfig.from_pretrained(args.model_path)
        model = load_pretrained(args.model_path, device=device, dtype=args.torch_dtype(config.dtype),
                                load_format="dummy" if args.load_format == "dummy" else "auto",
                                seed=args.random_seed)
        if args.quantization == "fp8":
            from slime_like.reference_engine.fp8 import quantize_model

            quantize_model(model, args.tp_size)
        # Say "loaded" before joining the group: if loading failed, rank 0 hears the error
        # instead of waiting in the rendezvous for a rank that will never come.
        conn.send(("loaded", None))
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=args.tp_size, timeout=timedelta(seconds=_READY_TIMEOUT_S))
        receiver = WeightReceiver(model, tp_rank=rank, tp_size=args.tp_size, device=device,
                                  model_path=args.model_path, load_format=args.load_format,
                                  seed=args.random_seed, cpu_backup=args.enable_weights_cpu_backup)
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001 - reported to rank 0, which fails the launch
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        try:
            result = receiver.run(msg)
            if hasattr(result, "wait"):  # a Completion: finish the copy before answering
                result = result.wait()
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 - rank errors travel back to the HTTP answer
            conn.send(("error", f"{type(e).__name__}: {e}"))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class TPGroup:
    """The rank processes of one engine and the connections rank 0 drives them through."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.size = args.tp_size
        # One node: rank 0 serves the group's store on a port the kernel gives it at bind
        # time, so no other process can take the port between a pick and the bind.
        self._store = None if args.nnodes > 1 else host_store(
            args.tp_size, timedelta(seconds=_READY_TIMEOUT_S), host="127.0.0.1")
        self.init_method = default_group_init_method(
            args, None if self._store is None else self._store.port)
        self._procs: list[mp.Process] = []  # ranks 1..k-1 on this node
        self._conns: list[Any] = []  # ranks 1..N-1, local pipes first, then remote ranks
        self._driver = None
        self._node_watch = None
        ctx = mp.get_context("spawn")
        for rank in args.node_ranks(0)[1:]:
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, args, self.init_method, child_conn),
                               name=f"reference-tp{rank}", daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        if args.nnodes > 1:
            from slime_like.reference_engine.multinode import RankDriver

            self._driver = RankDriver(args)
        self._stopping = False

    def _is_local(self, rank: int) -> bool:
        return rank < self.args.ranks_per_node

    def _expect(self, rank: int, conn, wanted: str) -> None:
        proc = self._procs[rank - 1] if self._is_local(rank) else None
        deadline = time.monotonic() + _READY_TIMEOUT_S
        try:
            while not conn.poll(0.2):
                if proc is not None and not proc.is_alive():
                    raise LaunchError(f"TP rank {rank} exited with code {proc.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise LaunchError(f"TP rank {rank} did not report '{wanted}' in {_READY_TIMEOUT_S:.0f}s")
            status, detail = conn.recv()
        except (EOFError, OSError) as e:
            raise LaunchError(f"TP rank {rank} went away while starting ({e})") from e
        if status != wanted:
            raise LaunchError(f"TP rank {rank} failed to start", detail or "")

    def wait_ready(self) -> None:
        """Wait until every rank (here and on other nodes) loaded its model, join the default
        gloo group as rank 0, then wait for every rank's ready message."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        if self._driver is not None:
            for rank in range(self.args.ranks_per_node, self.size):
                self._conns.append(self._driver.wait_rank(rank, deadline))
        for rank, conn in enumerate(self._conns, start=1):
            self._expect(rank, conn, "loaded")
        # The other ranks join through init_method, which prefixes their keys "default_pg"
        # (torch's rendezvous): rank 0 on its own store must use the same prefix.
        rendezvous = {"init_method": self.init_method} if self._store is None else {
            "store": dist.PrefixStore("default_pg", self._store)}
        dist.init_process_group("gloo", rank=0, world_size=self.size,
                                timeout=timedelta(seconds=_READY_TIMEOUT_S), **rendezvous)
        for rank, conn in enumerate(self._conns, start=1):
            self._expect(rank, conn, "ready")
        if self._procs:
            threading.Thread(target=self._watch_ranks, name="tp-rank-watch", daemon=True).start()
        if self._driver is not None:
            from slime_like.reference_engine.multinode import NodeWatch

            self._node_watch = NodeWatch(self._driver.wait_nodes(deadline), self._lost)

    def _lost(self, reason: str) -> None:
        """A rank is gone: take the server down, as a crashed sglang scheduler does."""
        logger.error("%s; shutting the engine down", reason)
        for other in self._procs:
            if other.is_alive():
                other.kill()
        os._exit(1)

    def _watch_ranks(self) -> None:
        """A local TP rank that dies takes the server down."""
        while not self._stopping:
            for rank, proc in enumerate(self._procs, start=1):
                if not proc.is_alive() and not self._stopping:
                    self._lost(f"TP rank {rank} exited with code {proc.exitcode}")
            time.sleep(0.2)

    def run(self, ops: Sequence[RankOp], local: Callable[[RankOp], Any],
            timeout: float = RANK_TIMEOUT_S) -> list[tuple[bool, Any]]:
        """`ops[r]` on every rank r: ranks 1..N-1 through their pipes, rank 0 by `local` in
        this thread; [(ok, result)] in rank order (a failure's result is its message)."""
        for conn, o in zip(self._conns, ops[1:], strict=True):
            conn.send(o)
        try:
            results: list[tuple[bool, Any]] = [(True, local(ops[0]))]
        except Exception as e:  # noqa: BLE001 - becomes the HTTP answer
            results = [(False, f"{type(e).__name__}: {e}")]
        for status, value in self.collect(timeout=timeout):
            results.append((status == "ok", value))
        return results

    def collect(self, timeout: float | None = None) -> list[tuple[str, Any]]:
        """The (status, result) of ranks 1..N-1 for the operations last sent."""
        out = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                if not conn.poll(timeout):
                    out.append(("error", f"TP rank {rank} did not answer in {timeout}s"))
                    continue
                out.append(conn.recv())
            except (EOFError, OSError):
                out.append(("error", f"TP rank {rank} exited"))
        return out

    def alive(self) -> bool:
        """True while every local rank process runs (remote nodes are watched by heartbeat)."""
        return all(p.is_alive() for p in self._procs)

    def shutdown(self) -> None:
        """Ask ranks (and other nodes) to exit, kill local ones that don't, leave the group."""
        self._stopping = True
        if self._node_watch is not None:
            self._node_watch.shutdown()
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if self._driver is not None:
            self._driver.close()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
