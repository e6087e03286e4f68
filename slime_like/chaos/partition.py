"""The chaos fault `partition`: one engine host's cluster link cut for a while, then restored.

A partition is not something a job can do to itself: only the machine's network can. The
fault therefore runs a command the operator gives (`--chaos-partition-command`), with
`{node_ip}` (the engine host's address as Ray knows it) and `{seconds}` filled in. The
command must cut that host off the cluster network and bring it back after `{seconds}`
by itself (it may return at once): the job never needs root for it, and the heal does not
depend on the job, which may be anywhere when it is due. On the test hosts
(`tests/hosts/`) the command asks the harness's switch to take the host's port down; on a
real cluster it could be a managed switch's API or a `systemd-run` timer over ssh.

Only a host of its own can be cut: one that runs an engine of the updatable model, no
trainer rank and not the job's driver (where the routers run). A job with none fails at
placement, naming where everything landed.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import time
from typing import Any

import ray

from slime_like.config.chaos_flags import PARTITION, check_partition_command
from slime_like.config.layout import JobPlan
from slime_like.errors import ConfigError

__all__ = ["PARTITION", "Partitioner", "check_partitionable", "partitionable_nodes",
           "partitioner_for"]

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 30.0


def partitionable_nodes(plan: JobPlan, driver_ip: str) -> dict[str, list[str]]:
    """Node IP -> the engines of the updatable model on it, for every node that runs no
    trainer rank and is not the driver's (whose routers and trainer must stay reachable)."""
    busy = {driver_ip, *(t.node_ip for t in plan.trainer)}
    engines: dict[str, set[str]] = {}  # engine id -> its nodes (a multi-node engine has several)
    for p in plan.engines_of(plan.updatable_model):
        engines.setdefault(p.engine_id, set()).add(p.node_ip)
    out: dict[str, list[str]] = {}
    for engine, nodes in engines.items():
        if not nodes & busy:
            for ip in sorted(nodes):
                out.setdefault(ip, []).append(engine)
    return out


def check_partitionable(plan: JobPlan, driver_ip: str) -> dict[str, list[str]]:
    """`partitionable_nodes`, or a ConfigError saying where everything landed."""
    nodes = partitionable_nodes(plan, driver_ip)
    if nodes:
        return nodes
    engines = sorted({f"{e.engine_id}@{e.node_ip}" for e in plan.http_engines(
        plan.updatable_model)})
    trainer = sorted({t.node_ip for t in plan.trainer})
    raise ConfigError("--chaos-faults partition", (
        "no engine host can be partitioned: the fault cuts the cluster link of a host that "
        "runs engines and neither a trainer rank nor the driver, and here the engines are on "
        f"{engines}, the trainer on {trainer}, the driver on {driver_ip}. A partition needs "
        "hosts with network stacks of their own (one Ray node per host, as tests/hosts makes "
        "them); on one machine, leave `partition` out of --chaos-faults"))


def partitioner_for(chaos: Any, plan: JobPlan) -> Partitioner | None:
    """The job's partitioner when its chaos run has `partition` (a ConfigError when no host
    can be cut, before any engine starts); None otherwise. `chaos`: its ChaosSettings."""
    if chaos.seed is None or PARTITION not in chaos.faults:
        return None
    # the driver's node: where the routers run
    nodes = check_partitionable(plan, ray.util.get_node_ip_address())
    return Partitioner(chaos.partition_command, chaos.partition_seconds, nodes)


class Partitioner:
    """Fires `partition` faults: cuts a partitionable engine host for `seconds`."""

    def __init__(self, command: str, seconds: float, nodes: dict[str, list[str]]):
        self.words = check_partition_command(command)
        self.seconds = seconds
        self.nodes = nodes  # node IP -> engine ids on it
        self.cuts: list[dict[str, Any]] = []

    def pick(self, index: int, live: list[str]) -> tuple[str, str]:
        """(node IP, engine id): the `index`-th partitionable engine (seeded), preferring
        one that serves now (`live`)."""
        pairs = [(ip, e) for ip, engines in sorted(self.nodes.items()) for e in engines]
        serving = [p for p in pairs if p[1] in live] or pairs
        return serving[index % len(serving)]

    def cut(self, node_ip: str, engine: str) -> dict[str, Any]:
        """Run the command for `node_ip`; what happened (raises if the command failed: the
        fault did not land, and the run must not pass as if it had)."""
        argv = [w.format(node_ip=node_ip, seconds=f"{self.seconds:g}") for w in self.words]
        t0 = time.time()
        r = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
        cut = {"node_ip": node_ip, "engine": engine, "cut_at": t0,
               "heals_at": t0 + self.seconds, "command": shlex.join(argv),
               "returncode": r.returncode}
        self.cuts.append(cut)
        if r.returncode != 0:
            raise RuntimeError(f"chaos partition of {node_ip} ({engine}): {shlex.join(argv)} "
                               f"exited {r.returncode}: {(r.stderr or r.stdout)[-500:]}")
        logger.warning("chaos: partitioned %s (%s) for %g s", node_ip, engine, self.seconds)
        return cut
