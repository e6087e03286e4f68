"""A private Ray cluster: started on free ports, stopped whole, other processes untouched."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile

import psutil
import pytest

from slime_like.errors import LaunchError
from slime_like.submit.local_cluster import cluster_processes, start_cluster, stop_cluster
from tests.scripts.port_helpers import RAY_FIXED_DEFAULT_PORTS, hold


def _is_job_agent(p: psutil.Process) -> bool:
    return p.name() == "ray::DashboardAgent" or "dashboard/agent.py" in " ".join(p.cmdline())


def test_start_avoids_taken_defaults_and_stop_reaches_renamed_agents_only():
    temp_dir = tempfile.mkdtemp(prefix="slr.")  # not tmp_path: Ray's socket paths are short
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    held = [hold(p) for p in RAY_FIXED_DEFAULT_PORTS]  # as if another cluster had them
    cluster = None
    try:
        cluster = start_cluster(temp_dir, num_cpus=1, num_gpus=0)
        found = cluster_processes(temp_dir, cluster.gcs_port)
        names = {p.name() for p in found}
        assert {"gcs_server", "raylet"} <= names, names
        # the job agent came up although its default port is taken (Ray 2.60 renames its
        # process to ray::DashboardAgent, dropping the command line the old pkill matched)
        assert [p for p in found if _is_job_agent(p)], names
        assert bystander.pid not in {p.pid for p in found}
    finally:
        for s in held:
            if s is not None:
                s.close()
        pids = stop_cluster(temp_dir, cluster.gcs_port if cluster else None)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert pids and not [p for p in pids if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert bystander.poll() is None, "a process outside the cluster was stopped"
    bystander.kill()
    bystander.wait()


def test_a_failed_start_raises_with_rays_own_words(tmp_path):
    with pytest.raises(LaunchError) as err:
        start_cluster(str(tmp_path), num_cpus=-1, num_gpus=0)
    assert "ray start --head in" in str(err.value) and "exited" in str(err.value)
    assert err.value.log_tail
