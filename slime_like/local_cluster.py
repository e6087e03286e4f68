"""Stop one private Ray cluster on this machine, leaving any other Ray cluster alone.

    python -m slime_like.local_cluster stop --temp-dir DIR --gcs-port PORT

`ray stop` (Ray 2.60) takes only `--force` and `--grace-period`: it stops every Ray
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
import sys
from collections.abc import Sequence

import psutil


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
    p = argparse.ArgumentParser(prog="python -m slime_like.local_cluster",
                                description="Stop one private Ray cluster of this machine.")
    sub = p.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="Stop the cluster's processes (and theirs).")
    stop.add_argument("--temp-dir", required=True, help="The cluster's `ray start --temp-dir`.")
    stop.add_argument("--gcs-port", type=int, default=None, help="The cluster's `--port`.")
    stop.add_argument("--grace", type=float, default=5.0, help="Seconds before SIGKILL.")
    a = p.parse_args(argv)
    pids = stop_cluster(a.temp_dir, a.gcs_port, a.grace)
    print(f"[slime_like] stopped the Ray cluster in {a.temp_dir}: {len(pids)} processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
