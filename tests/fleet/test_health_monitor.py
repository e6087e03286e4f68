"""HealthMonitor against real reference-engine processes.

A paused engine is a real hang: sglang's /health_generate blocks while generation is
paused, exactly what a wedged scheduler looks like from outside.
"""

from __future__ import annotations

import sys
import time

import pytest

from slime_like.cluster.ports import free_port
from slime_like.cluster.process import ServerProcess
from slime_like.engine.client import EngineClient
from slime_like.fleet.health import HealthMonitor, HealthPolicy


@pytest.fixture
def engines(tiny_model_dir, tmp_path):
    procs, clients = {}, {}
    for name in ("a", "b"):
        port = free_port()
        proc = ServerProcess([sys.executable, "-m", "slime_like.reference_engine", "--model-path",
                              str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port)],
                             log_path=tmp_path / f"{name}.log", name=name)
        proc.start()
        client = EngineClient(f"http://127.0.0.1:{port}", timeout=10)
        proc.wait_healthy(lambda c=client: c.health(timeout=2), timeout=90)
        procs[name], clients[name] = proc, client
    yield procs, clients
    for proc in procs.values():
        proc.terminate(grace=5)


def _monitor(procs, clients, dead, updating=(), reports=None, **policy):
    reports = reports if reports is not None else []
    return HealthMonitor(
        probe=lambda key, timeout: clients[key].health_generate(timeout=timeout),
        is_alive=lambda key: procs[key].is_alive(),
        on_dead=lambda key, reason: dead.append((key, reason)),
        policy=HealthPolicy(interval_s=0.2, **policy),
        should_probe=lambda key: key not in updating,
        on_suspect=lambda key, why: reports.append(("suspect", key)),
        on_healthy=lambda key: reports.append(("healthy", key)))


def test_a_killed_engine_is_dead_at_the_first_round_and_a_hung_one_after_n_timeouts(engines):
    procs, clients = engines
    dead: list[tuple[str, str]] = []
    reports: list = []
    mon = _monitor(procs, clients, dead, reports=reports, timeout_s=1.0, failure_threshold=2,
                   first_wait_s=0)
    mon.watch("a")
    mon.watch("b")
    assert mon.check_once() == [] and dead == []

    clients["b"].pause_generation("in_place")  # /health_generate now blocks: a hang
    procs["a"].kill()
    procs["a"].wait_exit(10)
    reported_at = {}
    mon.on_dead = lambda key, reason: (dead.append((key, reason)),
                                       reported_at.setdefault(key, time.monotonic()))
    t0 = time.monotonic()
    assert mon.check_once() == ["a"]            # liveness: no threshold to wait for
    assert reported_at["a"] - t0 < 0.5          # b's hung probe did not hold the report up
    assert dead == [("a", "server process exited")]
    assert reports == [("suspect", "b")]        # the first failed probe is reported at once
    assert mon.check_once() == ["b"]            # b: its second timeout in a row
    assert "2 consecutive failed probes" in dead[1][1] and "timed out" in dead[1][1]
    clients["b"].continue_generation()


def test_grace_and_pause_keep_a_busy_or_updating_engine_alive(engines):
    procs, clients = engines
    dead: list[tuple[str, str]] = []
    updating: set[str] = set()
    mon = _monitor(procs, clients, dead, updating=updating, timeout_s=0.5, failure_threshold=1,
                   first_wait_s=30)
    mon.watch("b")                      # just (re)started: in its grace period
    clients["b"].pause_generation("in_place")
    try:
        assert mon.check_once() == []   # cold start: a slow probe is not a death
        mon.watch("b", grace=False)
        updating.add("b")               # the fleet says: paused for a weight update
        assert mon.check_once() == []   # not probed at all
        updating.discard("b")
        assert mon.check_once() == ["b"]
    finally:
        clients["b"].continue_generation()
    assert dead and dead[0][0] == "b"


def test_a_suspect_that_answers_again_is_reported_healthy(engines):
    procs, clients = engines
    dead: list[tuple[str, str]] = []
    reports: list = []
    mon = _monitor(procs, clients, dead, reports=reports, timeout_s=0.5, failure_threshold=3,
                   first_wait_s=0)
    mon.watch("b")
    clients["b"].pause_generation("in_place")
    try:
        assert mon.check_once() == []
    finally:
        clients["b"].continue_generation()
    assert mon.check_once() == [] and dead == []
    assert reports == [("suspect", "b"), ("healthy", "b")]
