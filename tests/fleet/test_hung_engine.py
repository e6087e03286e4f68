"""A hung engine costs the others nothing: a sync lands on them, a rollout's requests go
elsewhere, each once the hung engine missed its deadline, not the health monitor's budget;
and a sync's "hung" is a suspicion, not a death: an engine that answers again is resynced
in place (one the health monitor calls dead is relaunched: `test_elastic.py`'s stopped
engine, on the shared 8-engine fleet).

Real Ray, the real sglang-router, two reference-engine processes; the fault is a real
SIGSTOP of one engine's server. One fleet for the module, its health monitor on with a
budget for a death (2 failed probes of up to 5 s, 1 s apart) far above the deadlines (a
sync's calls: 0.1 s floor; probes: 1 s floor; or 10x what each took lately), so the tests
can tell which of the two found the engine: they assert the order of the fleet's events,
never a time. Every stopped process is continued (or is already gone) before its test
ends; after the fleet's shutdown no engine process is left and every engine's port is
free again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import threading
import time
from collections import Counter
from urllib.parse import urlparse

import psutil
import pytest
import ray
import torch
from fleet_checks import (
    check_landed_while_suspect,
    first,
    recorder,
    routed_urls,
    stopped,
    wait_all_registered,
)

from slime_like.api import (
    EngineSettings,
    EngineState,
    FleetWeights,
    Happening,
    HealthSettings,
    RouterSettings,
    launch_fleet,
)
from slime_like.models import load_pretrained

FLEET_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "own_trainer",
                          "fleet.yaml")
HEALTH = HealthSettings(enabled=True, interval_s=1.0, timeout_s=5.0, first_wait_s=3.0,
                        failure_threshold=2)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir, fleet_ray):
    """Two engines (each decode step at least 10 ms, as on a GPU) behind a round-robin
    router, probed every second; after its shutdown, no process or port of it is left."""
    f = launch_fleet(FLEET_YAML, model_path=tiny_model_dir, log_dir=tmp_path_factory.mktemp("hung"),
                     engine=EngineSettings(program="reference", reference_min_step_ms=10.0),
                     router=RouterSettings(flags={"policy": "round_robin"}), health=HEALTH)
    seen: dict[int, int] = {}  # every engine server pid the tests saw -> its port
    f.seen_servers = seen
    router_port = urlparse(f.router_url()).port
    try:
        yield f
    finally:
        for e in f.engines:
            with contextlib.suppress(Exception):
                seen[server_pid(e)] = urlparse(e.url).port
        f.shutdown()
    assert_gone(seen, [router_port])


def server_pid(e) -> int:
    return ray.get(e.actors[0].server_pid.remote())


def assert_gone(servers: dict[int, int], ports: list[int], timeout: float = 30.0) -> None:
    """No engine server process alive, and each one's port (and the router's) free to
    bind again."""
    deadline = time.monotonic() + timeout
    while any(_running(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in servers if _running(pid)], "engine processes left behind"
    for port in [*servers.values(), *ports]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # raises if something still listens there


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def probes_have_a_deadline(fleet, timeout: float = 30.0) -> None:
    """Wait until enough probes answered for their deadline to be derived (below the
    probe timeout): before that, only the timeout finds a hang."""
    clock = fleet.health.monitor.clock
    deadline = time.monotonic() + timeout
    while "health_generate" not in clock.snapshot() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "health_generate" in clock.snapshot(), clock.basis("health_generate")


def test_requests_on_an_engine_hung_during_rollout_go_elsewhere_at_its_deadline(
        fleet, tiny_model_dir):
    """First in the module: its probes' deadline is derived from a quiet fleet's probes,
    not from those a relaunch elsewhere on two cores slowed down."""
    weights = FleetWeights(fleet, transport="distributed")
    weights.push(load_pretrained(tiny_model_dir, dtype=torch.float32))  # both routed
    weights.close()
    probes_have_a_deadline(fleet)
    victim = fleet.engines[1]
    pid = server_pid(victim)
    fleet.seen_servers[pid] = urlparse(victim.url).port
    events = recorder(fleet)
    hung_at: list[int] = []
    running = threading.Event()

    def stop_once_it_runs_requests() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not running.is_set():
            loads = victim.handle.loads().get("loads") or [{}]
            if sum(int(x.get("num_running_reqs", 0)) for x in loads) >= 2:
                os.kill(pid, signal.SIGSTOP)
                hung_at.append(len(events))
                running.set()
                return
            time.sleep(0.01)

    prompts, n = [[1, 72 + i, 105] for i in range(8)], 4
    params = {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True}
    stopper = threading.Thread(target=stop_once_it_runs_requests, daemon=True)
    stopper.start()
    try:
        samples = fleet.generate(prompts, n, params)
        done_at = len(events)
    finally:
        running.set()
        stopper.join(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert hung_at, "the victim never ran requests"
    # every sample back exactly once, some of them resubmitted away from the victim
    assert len(samples) == len(prompts) * n
    assert Counter(s.prompt_index for s in samples) == {i: n for i in range(len(prompts))}
    assert all(len(s.output_ids) == 48 for s in samples)
    assert fleet.generation.last["resubmitted"] > 0
    # the order: stopped, then out of the router at its probe's deadline (SUSPECT), then
    # the rollout ended; not declared dead (the monitor's budget) before it ended
    suspect = first(events, hung_at[0], subject=victim.engine_id, kind=EngineState.SUSPECT)
    assert suspect is not None and suspect < done_at, events
    assert "deadline" in str(events[suspect].details.get("reason")), events[suspect]
    dead = first(events, subject=victim.engine_id, kind=EngineState.DEAD)
    assert dead is None or dead > done_at, events
    # continued, it serves again (or, had the monitor given it up meanwhile, its replacement)
    wait_all_registered(fleet)
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


def synced_steps(weights: FleetWeights, model, n: int = 3) -> list[float]:
    """`n` pushes to the whole fleet (every call type answered by both engines: the
    sync's deadlines have a basis); each one's seconds."""
    steps = []
    for _ in range(n):
        t0 = time.perf_counter()
        weights.push(model)
        steps.append(time.perf_counter() - t0)
    return steps


def test_an_engine_continued_after_it_hung_in_a_sync_is_resynced_not_relaunched(
        fleet, tiny_model_dir):
    """Stopped across a sync and continued at once (a debugger, a wedged host that comes
    back, a deadline too short for a loaded machine): the same server serves again at the
    fleet's version, resynced; never DEAD, never relaunched."""
    model = load_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = FleetWeights(fleet, transport="distributed", update_weight_buffer_size=1 << 16)
    steps = synced_steps(weights, model)
    # A warm-up call past its (tight) deadline on a loaded machine makes an engine SUSPECT
    # and resyncs it alone: both must be serving before the stop, or the push under test
    # would leave the stopped one out without finding it hung.
    wait_all_registered(fleet)
    hung, other = fleet.engines
    fleet.seen_servers[pid := server_pid(hung)] = urlparse(hung.url).port
    expected = fleet.version.next().wire
    events = recorder(fleet)
    asked: list[list[str]] = []  # whom the retry asks whether they answer (the real call)
    ask = fleet.unresponsive
    fleet.unresponsive = lambda engines: (asked.append([e.url for e in engines]), ask(engines))[1]
    try:
        with stopped(pid):  # just before the sync, as a wedged host or a debugger would
            t0 = time.perf_counter()
            report = weights.push(model)
            step_after = time.perf_counter() - t0
    finally:
        del fleet.unresponsive
    check_landed_while_suspect(fleet, events, hung, [other], report, expected)
    # found hung at its pause, before any update went out: left behind by the same sync,
    # which went on with the other engine (no failed attempt, no retry asking who answers)
    assert list(report["hung"]) == [hung.url] and "pause_generation" in report["hung"][hung.url]
    assert asked == [], asked
    print(f"\nstep after SIGSTOP {step_after:.3f}s against a median step of "
          f"{statistics.median(steps):.3f}s ({step_after / statistics.median(steps):.1f}x)")
    wait_all_registered(fleet)
    # the same server, resynced in place: SUSPECT, then STALE once it answered, then
    # synced alone and routed at the fleet's version; never DEAD
    mine = [ev.kind for ev in events if ev.subject == hung.engine_id]
    assert EngineState.DEAD not in mine and Happening.RECOVERED not in mine, events
    assert mine[mine.index(EngineState.SUSPECT):][:4] == [
        EngineState.SUSPECT, EngineState.STALE, EngineState.UPDATING,
        EngineState.REGISTERED], events
    assert server_pid(hung) == pid and hung.restarts == 0
    assert {e.handle.weight_version() for e in fleet.engines} == {expected}
    assert routed_urls(fleet) == {e.url for e in fleet.engines}
    weights.close()
