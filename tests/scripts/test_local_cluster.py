"""Stopping a private Ray cluster stops all of its processes and nothing else."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import psutil

from slime_like.local_cluster import cluster_processes, stop_cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stop_reaches_renamed_agents_and_spares_other_processes():
    temp_dir = tempfile.mkdtemp(prefix="slr.")  # not tmp_path: Ray's socket paths are short
    gcs_port, dash_port = _free_port(), _free_port()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    try:
        subprocess.run([ray_bin, "start", "--head", "--temp-dir", temp_dir, "--port", str(gcs_port),
                        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash_port),
                        "--include-dashboard", "true", "--num-cpus", "1",
                        "--disable-usage-stats"], check=True, capture_output=True, timeout=180)
        found = cluster_processes(temp_dir, gcs_port)
        names = {p.name() for p in found}
        assert {"gcs_server", "raylet", "ray::DashboardAgent"} <= names, names
        assert bystander.pid not in {p.pid for p in found}
    finally:
        pids = stop_cluster(temp_dir, gcs_port)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert pids and not [p for p in pids if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert bystander.poll() is None, "a process outside the cluster was stopped"
    bystander.kill()
    bystander.wait()
