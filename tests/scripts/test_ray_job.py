"""Submitting to a real private Ray cluster: logs are followed, the job's outcome is the exit code."""

from __future__ import annotations

import shutil
import sys
import tempfile

import pytest

from slime_like.submit.local_cluster import start_cluster, stop_cluster
from slime_like.submit.ray_job import run


@pytest.fixture(scope="module")
def dashboard():
    """A one-node private Ray cluster; its dashboard address."""
    temp_dir = tempfile.mkdtemp(prefix="slr.")  # not tmp_path: Ray's socket paths are short
    cluster = None
    try:
        cluster = start_cluster(temp_dir, num_cpus=1, num_gpus=0)
        yield cluster.dashboard_url
    finally:
        stop_cluster(temp_dir, cluster.gcs_port if cluster else None)
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
