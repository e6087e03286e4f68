"""Submitting to a real private Ray cluster: logs are followed, the job's outcome is the exit code."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from slime_like.local_cluster import stop_cluster
from slime_like.ray_job import run


@pytest.fixture(scope="module")
def dashboard():
    """A one-node Ray cluster on free ports; its dashboard address."""
    socks = [socket.socket() for _ in range(7)]
    for s in socks:
        s.bind(("", 0))
    gcs, dash, agent, agent_grpc, client, metrics, env_agent = (s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    temp_dir = tempfile.mkdtemp(prefix="slr.")  # not tmp_path: Ray's socket paths are short
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    try:
        subprocess.run([ray_bin, "start", "--head", "--temp-dir", temp_dir, "--port", str(gcs),
                        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                        "--include-dashboard", "true", "--dashboard-agent-listen-port", str(agent),
                        "--dashboard-agent-grpc-port", str(agent_grpc),
                        "--ray-client-server-port", str(client),
                        "--metrics-export-port", str(metrics),
                        "--runtime-env-agent-port", str(env_agent), "--num-cpus", "1",
                        "--disable-usage-stats"], check=True, capture_output=True, timeout=180)
        yield f"http://127.0.0.1:{dash}"
    finally:
        stop_cluster(temp_dir, gcs)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_succeeding_job_streams_its_log_and_exits_0(dashboard, capsys):
    code = run(dashboard, [sys.executable, "-c", "import os; print('hello from', os.environ['X'])"],
               env={"X": "the job"}, timeout_s=180)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "hello from the job" in out
    assert "submitted job slime_like_" in out


def test_a_failing_job_exits_1_and_says_how_it_ended(dashboard, capsys):
    code = run(dashboard, [sys.executable, "-c", "import sys; sys.exit(3)"], env={},
               timeout_s=180)
    assert code == 1
    assert "ended FAILED" in capsys.readouterr().err
