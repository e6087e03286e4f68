"""Start and stop one private Ray cluster on this machine, leaving any other alone.

    python -m slime_like.submit.local_cluster start --temp-dir DIR --num-cpus N --num-gpus G
    python -m slime_like.submit.local_cluster stop --temp-dir DIR --gcs-port PORT

Start: every port Ray would otherwise take at a fixed default (the dashboard agent's 52365,
the client server's 10001, ...) is picked free, so a second cluster on the machine does not
end up without a job agent ("No available agent to submit job").

Stop: `ray stop` (Ray 2.60) takes only `--force` and `--grace-period`: it stops every Ray
process of the machine, so it cannot be used where other clusters run. Matching command
lines on the temp dir misses processes that rename themselves (`ray::DashboardAgent`,
`ray::RuntimeEnvAgent`, workers) or do not name it (the Ray client server names only the
GCS address). So: the roots are processes naming the cluster's temp dir or its GCS port;
the cluster is the roots and all their descendants.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from slime_like.cluster.ports import free_ports
from slime_like.errors import LaunchError

PORT_FLAGS = ("--port", "--dashboard-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--ray-client-server-port", "--metrics-export-port",
              "--runtime-env-agent-port")


@dataclass(frozen=True)
class PrivateCluster:
    """A started cluster: where its files are, its GCS port and its dashboard (job API)."""

    temp_dir: str
    gcs_port: int
    dashboard_port: int

    @property
    def dashboard_url(self) -> str:
        """Where `ray job` and the job SDK reach it."""
        return f"http://127.0.0.1:{self.dashboard_port}"


def start_cluster(temp_dir: str, num_cpus: int, num_gpus: int, timeout_s: float = 300.0,
                  ray_bin: str | None = None) -> PrivateCluster:
    """`ray start --head` in `temp_dir` with every port free; LaunchError with the log if not."""
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    ray_bin = ray_bin or shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    argv = [ray_bin, "start", "--head", "--temp-dir", temp_dir, "--dashboard-host", "127.0.0.1",
            "--include-dashboard", "true", "--num-cpus", str(num_cpus), "--num-gpus",
            str(num_gpus), "--disable-usage-stats"]
    for flag, port in ports.items():
        argv += [flag, str(port)]
    log = os.path.join(temp_dir, "ray_start.log")
    with open(log, "w") as out:
        try:
            code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    if code != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise LaunchError(f"ray start --head in {temp_dir} "
                          + ("timed out" if code is None else f"exited {code}"), tail)
    return PrivateCluster(temp_dir, ports["--port"], ports["--dashboard-port"])


def cluster_processes(temp_dir: str, gcs_port: int | None = None) -> list[psutil.Process]:
    """Every live process of the cluster started with `--temp-dir temp_dir --port gcs_port`."""
    temp_dir = os.path.realpath(temp_dir)
    port_re = re.compile(rf"(:|=){gcs_port}(?!\d)") if gcs_port else None
    spare = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    roots = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] in spare or not cmd:
            continue
        if temp_dir in cmd or (port_re is not None and port_re.search(cmd)):
            roots.append(p)
    found: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for q in [root, *root.children(recursive=True)]:
                if q.pid not in spare:
                    found[q.pid] = q
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def _signal(procs: list[psutil.Process], kill: bool) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill() if kill else p.terminate()


def stop_cluster(temp_dir: str, gcs_port: int | None = None, grace_s: float = 5.0) -> list[int]:
    """SIGTERM the cluster's processes, SIGKILL what is left after `grace_s`; their pids."""
    procs = cluster_processes(temp_dir, gcs_port)
    _signal(procs, kill=False)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    _signal(alive, kill=True)
    psutil.wait_procs(alive, timeout=grace_s)
    # Processes forked while we were stopping the first ones (a raylet restarting a worker).
    late = cluster_processes(temp_dir, gcs_port)
    _signal(late, kill=True)
    return [p.pid for p in procs + late]


def main(argv: Sequence[str] | None = None) -> int:
    """`start` / `stop` from the command line (scripts/run_job.sh); the exit status."""
    p = argparse.ArgumentParser(prog="python -m slime_like.submit.local_cluster",
                                description="Start or stop one private Ray cluster of this "
                                            "machine.")
    sub = p.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="Start a head node; prints GCS_PORT DASHBOARD_PORT.")
    start.add_argument("--temp-dir", required=True, help="Its `ray start --temp-dir` (short).")
    start.add_argument("--num-cpus", type=int, required=True)
    start.add_argument("--num-gpus", type=int, required=True)
    stop = sub.add_parser("stop", help="Stop the cluster's processes (and theirs).")
    stop.add_argument("--temp-dir", required=True, help="The cluster's `ray start --temp-dir`.")
    stop.add_argument("--gcs-port", type=int, default=None, help="The cluster's `--port`.")
    stop.add_argument("--grace", type=float, default=5.0, help="Seconds before SIGKILL.")
    a = p.parse_args(argv)
    if a.command == "start":
        try:
            cluster = start_cluster(a.temp_dir, a.num_cpus, a.num_gpus)
        except LaunchError as e:
            print(f"[slime_like] {e}", file=sys.stderr)
            return 1
        print(cluster.gcs_port, cluster.dashboard_port)
        return 0
    pids = stop_cluster(a.temp_dir, a.gcs_port, a.grace)
    print(f"[slime_like] stopped the Ray cluster in {a.temp_dir}: {len(pids)} processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
