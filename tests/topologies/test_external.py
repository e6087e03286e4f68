"""configs/external_cpu.yaml end to end: two reference engines started outside the job are
attached, synced and routed like the job's own. One is SIGKILLed mid-run and started again
on the same port by its owner (the test): the job waits for it, resyncs it at the current
version and routes it again. The job never kills an external engine: both still run after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import requests

from slime_like.cluster.ports import free_port
from slime_like.models.tiny import make_tiny_model
from tests.topologies.job_checks import (
    check_run,
    metrics,
    run_job,
    states_of,
    timeline,
)

STEPS = 5
KILLED = "default/external/e1"


@pytest.fixture(scope="module")
def fresh_ray():
    """One local Ray cluster for the module's jobs (each starts its own fleet, trainer and
    placement group and stops them; the external engines are the tests' own processes)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def start(model: Path, port: int, log: Path, seed: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "slime_like.reference_engine", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--random-seed", str(seed)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"},
                                start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        time.sleep(0.2)
    raise AssertionError(f"engine on {port} not healthy: {log.read_text()[-2000:]}")


def kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def wait_for_steps(run_dir, n: int, timeout_s: float = 300) -> None:
    """Until the job has logged `n` steps (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if len(metrics(run_dir)) >= n:
                return
        time.sleep(0.1)


def test_external_engines_are_synced_routed_and_waited_for(tmp_path, fresh_ray):
    # the tiny model the job makes for itself (same seed and size): same names and shapes
    model = make_tiny_model(tmp_path / "ext_model", layers=2, hidden=64, seed=1234)
    ports = [free_port(), free_port()]
    procs = [start(model, p, tmp_path / f"ext{i}.log", seed=i + 1) for i, p in enumerate(ports)]
    run_dir = tmp_path / "run"
    restarted = threading.Event()

    def owner_restarts_engine_1() -> None:
        """Kill engine 1 once step 1 is logged, bring it back on its port 2 s later."""
        wait_for_steps(run_dir, 2)
        kill(procs[1])
        time.sleep(2)
        procs[1] = start(model, ports[1], tmp_path / "ext1.log", seed=2)
        restarted.set()

    owner = threading.Thread(target=owner_restarts_engine_1, daemon=True)
    owner.start()
    try:
        run_job(run_dir, "configs/external_cpu.yaml", "--num-rollout", str(STEPS),
                "--rollout-external-engine-addrs", *[f"127.0.0.1:{p}" for p in ports])
        owner.join(120)
        assert restarted.is_set()
        check_run(run_dir, STEPS, ["default/external/e0", KILLED])
        states = states_of(timeline(run_dir), KILLED)
        dead = states.index("DEAD")
        assert states[dead:dead + 5] == ["DEAD", "REATTACHING", "STALE", "UPDATING",
                                         "REGISTERED"], states
        assert "RECOVERED" in states
        # never killed by the job: both servers still run and answer
        for p, proc in zip(ports, procs, strict=True):
            assert proc.poll() is None
            assert requests.get(f"http://127.0.0.1:{p}/health", timeout=5).status_code == 200
    finally:
        for proc in procs:
            kill(proc)


def test_an_external_engine_that_stays_away_is_given_up_after_the_timeout(tmp_path, fresh_ray):
    model = make_tiny_model(tmp_path / "ext_model", layers=2, hidden=64, seed=1234)
    ports = [free_port(), free_port()]
    procs = [start(model, p, tmp_path / f"ext{i}.log", seed=i + 1) for i, p in enumerate(ports)]
    run_dir = tmp_path / "run"

    def owner_kills_engine_1() -> None:
        wait_for_steps(run_dir, 1)
        kill(procs[1])

    owner = threading.Thread(target=owner_kills_engine_1, daemon=True)
    owner.start()
    try:
        run_job(run_dir, "configs/external_cpu.yaml", "--num-rollout", "3",
                "--external-engine-reconnect-timeout", "2",
                "--rollout-external-engine-addrs", *[f"127.0.0.1:{p}" for p in ports])
        check_run(run_dir, 3, ["default/external/e0"])
        states = states_of(timeline(run_dir), KILLED)
        dead = states.index("DEAD")
        assert states[dead:dead + 3] == ["DEAD", "REATTACHING", "DEAD"], states
        assert "FAILED" in (run_dir / "report.md").read_text()
        assert "external-engine-reconnect-timeout" in (run_dir / "report.md").read_text()
    finally:
        for proc in procs:
            kill(proc)
