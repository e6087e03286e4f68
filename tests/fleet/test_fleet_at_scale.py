"""A fleet the size of a real cluster, faults and membership changes while it serves.

One fleet for the module: N reference engines (16 in CI; 64 under `-m slow`), 8 per
simulated node (`ray.cluster_utils.Cluster` nodes on 127.0.0.2, 127.0.0.3, ... with 8
declared GPUs each), the real sglang-router (round robin), the health monitor on with a
budget for a death (2 failed probes of up to 5 s, 1 s apart) far above the deadlines (a
sync's calls: 0.2 s floor; probes: 1 s floor; or 10x what each took lately), and every
forward step at least 20 ms (as on a GPU). `FleetWeights` pushes over a weight group.

Every scenario starts by checking that the fleet is whole: every engine REGISTERED, routed,
at the fleet's version. In module order:

- a hung engine during a rollout (a real SIGSTOP once it runs requests): its requests go
  elsewhere at its probe's deadline, every sample back once; first in the module, so its
  probes' deadline comes from a quiet fleet's probes;
- engines added and drained while requests run: a node joins and `add_engines` places the
  new engines there (groups of their own, waiting for that capacity: no spare launched at
  start), launches them after the command, resyncs them while the others serve and routes
  them only once verified at the fleet's version; `drain` with a deadline (0.3 s) far
  shorter than the drained engines' running requests (1.3 s or more): they are moved (aborted,
  continued elsewhere as prompt + partial output), none lost or doubled; the drained
  engines leave the weight group at the next push's regroup, then stop;
- `slime-like fleet scale RUN_DIR --engines N` against a running `ScaleWatcher` adds an
  engine on a freed bundle and drains it again;
- an engine hung across a sync (SIGSTOP) and continued at once: the sync lands on the
  others at its deadline, the hung engine left out (SUSPECT, unrouted), then resynced in
  place, never DEAD; one left stopped: relaunched only on the health monitor's verdict,
  after the sync landed;
- a node lost (its raylet and every process on it killed, as `Cluster.remove_node` does)
  while requests run: its engines are seen dead, the rounds and a push go on with the
  survivors, the fleet says it runs smaller, and when a node joins they are placed there,
  resynced and routed only at the fleet's version. The node lost is the one with the fewest
  engines (the added engines' node in module order; a launch node if run alone). Last of
  the faults: it changes the cluster itself, and what follows only needs a whole fleet;
- every engine serves the final version, and a round's every sample comes back once;
- nothing is left: every engine process and port of the module is gone after shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import fleet_checks
import psutil
import pytest
import ray
import torch
from fleet_checks import (
    Rounds,
    first,
    recorder,
    refused,
    running,
    stopped,
    wait_all_registered,
    wait_until,
)

from slime_like.api import (
    EngineSettings,
    EngineState,
    FleetLayout,
    FleetWeights,
    Happening,
    HealthSettings,
    RouterSettings,
    launch_fleet,
)
from slime_like.job.scaling import ScaleWatcher
from slime_like.models import load_pretrained
from slime_like.reference_engine.served_log import read_served
from tests.simulated_nodes import simulated_nodes

S = EngineState
ENGINES_PER_NODE = 8
STEP_MS = 20.0
MAX_NEW = 64  # a request of the rounds runs 1.3 s or more (64 steps of at least 20 ms)
ROUND_PARAMS = {"max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True}
HEALTH = HealthSettings(enabled=True, interval_s=1.0, timeout_s=5.0, first_wait_s=3.0,
                        failure_threshold=2)
NODE_DEATH_S = 4
# CI: 8 engines over two nodes (16 measured 38 s to launch and 135 s for the module on the
# 2-core CI machine, past its 90 s budget). `-m slow`: 64 engines over eight nodes, or
# SLIME_LIKE_FLEET_SCALE_ENGINES of them.
CI_ENGINES = 8
SLOW_ENGINES = int(os.environ.get("SLIME_LIKE_FLEET_SCALE_ENGINES", "64"))
SIZES = [
    pytest.param(CI_ENGINES, id=f"{CI_ENGINES}-engines"),
    pytest.param(SLOW_ENGINES, id=f"{SLOW_ENGINES}-engines",
                 marks=[pytest.mark.slow, pytest.mark.timeout(1800)]),
]


@pytest.fixture(scope="module", params=SIZES)
def big(request, tmp_path_factory, tiny_model_dir):
    """N engines over N/8 simulated nodes, pushed version 1; after its shutdown, no engine
    process or port of the module is left."""
    n = request.param
    ips = [f"127.0.0.{2 + i}" for i in range(max(2, n // ENGINES_PER_NODE))]
    spare = iter(f"127.0.0.{2 + i}" for i in range(len(ips), 250))
    events: list = []
    with simulated_nodes(ips, cpus=2 * (n // len(ips)), gpus=n // len(ips),
                         node_death_s=NODE_DEATH_S, dashboard=False) as cluster:
        fleet = launch_fleet(None, model_path=tiny_model_dir,
                             engine=EngineSettings(program="reference",
                                                   reference_min_step_ms=STEP_MS),
                             router=RouterSettings(flags={"policy": "round_robin"}),
                             health=HEALTH, layout=FleetLayout(num_gpus=n),
                             log_dir=tmp_path_factory.mktemp(f"fleet{n}"),
                             on_event=events.append, placement_timeout_s=600)
        big = SimpleNamespace(n=n, fleet=fleet, cluster=cluster, events=events, ips=ips,
                              next_ip=lambda: next(spare), closed=False,
                              urls={e.url for e in fleet.engines},
                              router=urlparse(fleet.router_url()))
        try:
            big.model = load_pretrained(tiny_model_dir, dtype=torch.float32)
            big.weights = FleetWeights(fleet, transport="distributed")
            big.weights.push(big.model)
            yield big
        finally:
            if not big.closed:
                big.weights.close()
                fleet.shutdown()


def routed_urls(fleet) -> set[str]:
    """The engines the real router of the fleet's updatable model lists now."""
    return fleet_checks.routed_urls(fleet, fleet.updatable_model)


def whole(big) -> None:
    """Each scenario's precondition: every engine REGISTERED, routed and serving the
    fleet's version (recoveries of an earlier scenario finished)."""
    fleet = big.fleet
    wait_all_registered(fleet)
    assert routed_urls(fleet) == {e.url for e in fleet.engines}
    assert {e.handle.weight_version() for e in fleet.engines} == {str(fleet.version)}
    big.urls |= {e.url for e in fleet.engines}


def events_of(big, engine_id: str) -> list:
    return [e for e in big.events if e.subject == engine_id]


def server_pid(e) -> int:
    return ray.get(e.actors[0].server_pid.remote())


def server_pids(big) -> dict[str, int]:
    """Every engine server of the module, by engine id and launch, from the events that
    name one (LOADED, and STALE after a relaunch)."""
    return {f"{e.subject}@{i}": e.details["pid"] for i, e in enumerate(big.events)
            if e.kind in (S.LOADED, S.STALE) and "pid" in e.details}


def node_of(e) -> str:
    return e.placements[0].node_ip


# ---- a hung engine during a rollout ------------------------------------------------------------


def probes_have_a_deadline(fleet, timeout: float = 30.0) -> None:
    """Wait until enough probes answered for their deadline to be derived (below the
    probe timeout): before that, only the timeout finds a hang."""
    clock = fleet.health.monitor.clock
    deadline = time.monotonic() + timeout
    while "health_generate" not in clock.snapshot() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "health_generate" in clock.snapshot(), clock.basis("health_generate")


def test_requests_on_an_engine_hung_during_rollout_go_elsewhere_at_its_deadline(big):
    """First in the module: its probes' deadline is derived from a quiet fleet's probes,
    not from those a relaunch elsewhere on two cores slowed down."""
    fleet = big.fleet
    whole(big)
    probes_have_a_deadline(fleet)
    victim = fleet.engines[1]
    pid = server_pid(victim)
    events = recorder(fleet)
    hung_at: list[int] = []
    ran = threading.Event()

    def stop_once_it_runs_requests() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ran.is_set():
            loads = victim.handle.loads().get("loads") or [{}]
            if sum(int(x.get("num_running_reqs", 0)) for x in loads) >= 2:
                os.kill(pid, signal.SIGSTOP)
                hung_at.append(len(events))
                ran.set()
                return
            time.sleep(0.01)

    # two prompts' samples per engine (round robin): the victim runs at least two
    prompts, n = [[1, 72 + i % 50, 105 + i // 50] for i in range(big.n // 2)], 4
    params = {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True}
    stopper = threading.Thread(target=stop_once_it_runs_requests, daemon=True)
    stopper.start()
    try:
        samples = fleet.generate(prompts, n, params)
        done_at = len(events)
    finally:
        ran.set()
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
    suspect = first(events, hung_at[0], subject=victim.engine_id, kind=S.SUSPECT)
    assert suspect is not None and suspect < done_at, events
    assert "deadline" in str(events[suspect].details.get("reason")), events[suspect]
    dead = first(events, subject=victim.engine_id, kind=S.DEAD)
    assert dead is None or dead > done_at, events
    # continued, it serves again (or, had the monitor given it up meanwhile, its replacement)
    wait_all_registered(fleet)
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


# ---- membership: engines added and drained while requests run -----------------------------------


def test_engines_added_and_drained_while_requests_run(big):
    fleet, weights = big.fleet, big.weights
    whole(big)
    # Every GPU of the cluster is taken: the add must wait for a node to join.
    assert fleet.capacity.free() == []
    adds = max(1, big.n // 16)
    first_ids = {e.engine_id for e in fleet.engines}
    model = fleet.updatable_model + "/"
    groups_before = max(fleet.placement.added, default=0)
    seen: dict[str, list[tuple]] = {}  # per added engine: (event, routed at that moment)

    def watch(event) -> None:
        if event.subject.startswith(model) and event.subject not in first_ids:
            e = next((x for x in fleet.engines if x.engine_id == event.subject), None)
            routed = e is not None and e.url is not None and e.url in routed_urls(fleet)
            seen.setdefault(event.subject, []).append((event, routed))

    fleet.subscribe(watch)
    rounds = Rounds(fleet, ROUND_PARAMS, prompts=big.n, n=2).start()
    try:
        asked = time.time()
        added: list[str] = []
        adding = threading.Thread(target=lambda: added.extend(fleet.add_engines(adds)))
        adding.start()
        time.sleep(0.5)
        assert not added and adding.is_alive()
        node = big.next_ip()
        big.cluster.add_node(num_cpus=2 * adds, num_gpus=adds, node_ip_address=node)
        adding.join(timeout=300)
        assert not adding.is_alive() and len(added) == adds
        new = [fleet.find(i) for i in added]
        # each on the new node, in a placement group of its own
        assert {node_of(e) for e in new} == {node}
        assert sorted(e.placements[0].placement_group for e in new) == \
            list(range(groups_before + 1, groups_before + adds + 1))
        assert {urlparse(e.url).hostname for e in new} == {node}
        big.urls |= {e.url for e in new}
        # Launched after the command; routed only once verified at the fleet's version.
        for e in new:
            mine = seen[e.engine_id]
            loaded = next(ev for ev, _ in mine if ev.kind is S.LOADED)
            assert psutil.Process(loaded.details["pid"]).create_time() >= asked - 0.5
            kinds = [ev.kind for ev, _ in mine if ev.is_state_change]
            assert kinds == [S.LAUNCHING, S.LOADED, S.STALE, S.UPDATING, S.REGISTERED], kinds
            assert [routed for ev, routed in mine if ev.is_state_change] == [False] * 4 + [True]
            assert mine[-1][0].details["version"] == str(fleet.version)
            assert e.handle.weight_version() == str(fleet.version)

        # Drain engines of the launch just after a round started: their requests run 1.3 s or more,
        # the deadline is 0.3 s, so they are moved.
        leaving = [e for e in fleet.engines if e.engine_id in first_ids][:adds]
        leaving_urls = [e.url for e in leaving]
        started = len(rounds.rounds)
        wait_until(lambda: len(rounds.rounds) > started, 120, "a round to end")
        wait_until(lambda: all((e.handle.in_flight() or 0) > 0 for e in leaving), 30,
                   "requests on the engines to drain")
        report = fleet.drain([e.engine_id for e in leaving], deadline_s=0.3)
        assert report.moved > 0, report
        # in the weight group of the last full update
        assert report.waiting_for_regroup == tuple(e.engine_id for e in leaving)
        assert {fleet.states()[e.engine_id] for e in leaving} == {S.DRAINING.value}
        assert not set(leaving_urls) & routed_urls(fleet)
        wait_until(lambda: len(rounds.rounds) > started + 1, 120, "the drained round to end")
    finally:
        results = rounds.stop()

    # Every round: each requested sample back exactly once, whole.
    for samples in results:
        assert len(samples) == 2 * big.n
        assert Counter(s.prompt_index for s in samples) == {i: 2 for i in range(big.n)}
        assert all(len(s.output_ids) == MAX_NEW and s.finish_reason == "length"
                   for s in samples)
    moved = [s for r in results for s in r if s.partial_resubmits]
    assert moved and rounds.gen.aborted > 0  # continued elsewhere, prompt + partial output

    # The next push regroups without them: they leave the group, then stop.
    joined = [weights.sync.transport.asked[url] for url in leaving_urls]  # the groups each joined
    assert all(j.groups for j in joined)
    weights.push(big.model)
    pushed = str(fleet.version)
    wait_until(lambda: not {e.engine_id for e in leaving} & set(fleet.states()), 60,
               "the drained engines to stop")
    version_event = next(ev for ev in big.events if ev.kind is Happening.VERSION
                         and ev.details["version"] == pushed)
    for e, url, j in zip(leaving, leaving_urls, joined, strict=True):
        mine = events_of(big, e.engine_id)
        assert [ev.kind for ev in mine[-3:]] == [S.DRAINING, Happening.DRAINED, S.STOPPED]
        assert mine[-1].at >= version_event.at
        # Asked to leave the old group (on the engine pool, not waited for: an engine that
        # left the membership may be dead), and did.
        wait_until(lambda j=j: not j.groups, 30, "a drained engine to leave the old group")
        pid = next(ev.details["pid"] for ev in mine if ev.kind is S.LOADED)
        wait_until(lambda pid=pid: not running(pid), 30, "a drained engine's server to exit")
        assert refused(url)
    assert set(fleet.states().values()) == {S.REGISTERED.value}
    assert {e.handle.weight_version() for e in fleet.engines} == {pushed}
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


def _scale(run_dir: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "slime_like.cli", "fleet", "scale",
                          str(run_dir), *args, "--wait", "120"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def free_launch_bundle(big) -> str:
    """The node of a free bundle of the job's own placement group (a drained engine gave
    it back); run alone, this scenario drains one of the launch to make one."""
    fleet = big.fleet
    if not [k for k in fleet.capacity.free() if k[0] == 0]:
        gone = next(e for e in reversed(fleet.engines) if e.placements[0].placement_group == 0)
        fleet.drain([gone.engine_id], deadline_s=5)
        big.weights.push(big.model)  # the regroup: it leaves the group and stops
        wait_until(lambda: gone.engine_id not in fleet.states(), 60, "the drained engine")
    free = {k for k in fleet.capacity.free() if k[0] == 0}
    return next(p.node_ip for e in fleet.retired for p in e.placements
                if (p.placement_group, p.bundle_index) in free)


def test_a_scale_command_resizes_the_running_fleet(big, tmp_path):
    fleet = big.fleet
    whole(big)
    freed_on = free_launch_bundle(big)
    before = len(fleet.engines)
    watcher = ScaleWatcher(fleet, tmp_path, poll_s=0.1).start()
    try:
        grown = _scale(tmp_path, "--engines", str(before + 1))
        assert grown["ok"] and grown["before"] == before and len(grown["added"]) == 1, grown
        new = fleet.find(grown["added"][0])
        big.urls.add(new.url)
        # the bundle a drained engine gave back, in the job's own placement group
        assert (new.placements[0].node_ip, new.placements[0].placement_group) == (freed_on, 0)
        assert new.handle.weight_version() == str(fleet.version)
        shrunk = _scale(tmp_path, "--engines", str(before), "--drain-deadline", "5")
        # the newest engine; resynced over its own group, it is in no group to leave
        assert [d["engine"] for d in shrunk["drained"]] == [new.engine_id], shrunk
        assert shrunk["waiting_for_regroup"] == []
        assert new.engine_id not in fleet.states()
    finally:
        watcher.stop()
    assert not (tmp_path / "scale" / "job.json").exists()
    big.weights.push(big.model)
    assert set(fleet.states().values()) == {S.REGISTERED.value}
    assert {e.handle.weight_version() for e in fleet.engines} == {str(fleet.version)}


# ---- a hung engine during a sync -----------------------------------------------------------------


def synced_steps(weights: FleetWeights, model, n: int = 3) -> list[float]:
    """`n` pushes to the whole fleet (every call type answered by every engine: the sync's
    deadlines have a basis); each one's seconds."""
    steps = []
    for _ in range(n):
        t0 = time.perf_counter()
        weights.push(model)
        steps.append(time.perf_counter() - t0)
    return steps


def a_launch_engine(big, index: int):
    """An engine of the launch never relaunched (its server the first), by position."""
    return [e for e in big.fleet.engines if e.restarts == 0
            and e.placements[0].placement_group == 0][index]


def check_landed_while_suspect(fleet, events: list, hung, others: list, report: dict,
                               expected: str) -> int:
    """The sync landed on every other engine at the next version, after the hung one was
    out of it and the router as SUSPECT for its pause past the deadline (not DEAD: the
    monitor's verdict never came first); the index of the fleet's VERSION event."""
    assert sorted(report["engines"]) == sorted(e.url for e in others)
    assert fleet.version.wire == expected
    assert {e.handle.weight_version() for e in others} == {expected}
    suspect = first(events, subject=hung.engine_id, kind=S.SUSPECT)
    landed = first(events, subject="fleet", kind=Happening.VERSION)
    assert suspect is not None and landed is not None and suspect < landed, events
    reason = str(events[suspect].details.get("reason"))
    assert "hung during a weight sync" in reason and "pause_generation" in reason, reason
    assert "deadline" in reason and hung.url in reason, reason
    dead = first(events, subject=hung.engine_id, kind=S.DEAD)
    assert dead is None or dead > landed, events
    return landed


def test_an_engine_continued_after_it_hung_in_a_sync_is_resynced_not_relaunched(big):
    """Stopped across a sync and continued at once (a debugger, a wedged host that comes
    back, a deadline too short for a loaded machine): the same server serves again at the
    fleet's version, resynced; never DEAD, never relaunched."""
    fleet, weights = big.fleet, big.weights
    whole(big)
    steps = synced_steps(weights, big.model)
    hung = a_launch_engine(big, 1)
    others = [e for e in fleet.engines if e is not hung]
    pid = server_pid(hung)
    expected = fleet.version.next().wire
    events = recorder(fleet)
    with stopped(pid):  # just before the sync, as a wedged host or a debugger would
        t0 = time.perf_counter()
        report = weights.push(big.model)
        step_after = time.perf_counter() - t0
        unrouted = hung.url not in routed_urls(fleet)  # left out of the router
    assert unrouted
    check_landed_while_suspect(fleet, events, hung, others, report, expected)
    print(f"\nstep after SIGSTOP {step_after:.3f}s against a median step of "
          f"{statistics.median(steps):.3f}s ({step_after / statistics.median(steps):.1f}x)")
    wait_all_registered(fleet)
    # the same server, resynced in place: SUSPECT, then STALE once it answered, then
    # synced alone and routed at the fleet's version; never DEAD
    mine = [ev.kind for ev in events if ev.subject == hung.engine_id]
    assert S.DEAD not in mine and Happening.RECOVERED not in mine, events
    assert mine[mine.index(S.SUSPECT):][:4] == [S.SUSPECT, S.STALE, S.UPDATING,
                                                S.REGISTERED], events
    assert server_pid(hung) == pid and hung.restarts == 0
    assert {e.handle.weight_version() for e in fleet.engines} == {expected}
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


def test_a_sync_lands_on_the_others_before_the_monitor_calls_the_hung_engine_dead(big):
    """Stopped across a sync and left stopped: the sync lands on the others at once; the
    hung one is relaunched only once the health monitor calls it dead."""
    fleet, weights = big.fleet, big.weights
    whole(big)
    synced_steps(weights, big.model)
    hung = a_launch_engine(big, 2)
    others = [e for e in fleet.engines if e is not hung]
    pid = server_pid(hung)
    expected = fleet.version.next().wire
    events = recorder(fleet)
    with stopped(pid):
        report = weights.push(big.model)
        landed = check_landed_while_suspect(fleet, events, hung, others, report, expected)
        assert hung.url not in routed_urls(fleet)  # left out of the router
        # recovered: the monitor's verdict (2 failed probes), then a new server that
        # serves the fleet's version, routed; the stopped one is gone
        wait_all_registered(fleet)
    dead = first(events, subject=hung.engine_id, kind=S.DEAD)
    assert dead is not None and dead > landed, events
    assert "consecutive failed probes" in str(events[dead].details.get("reason")), events[dead]
    assert first(events, dead, subject=hung.engine_id, kind=Happening.RECOVERED) is not None
    assert not running(pid)
    assert {e.handle.weight_version() for e in fleet.engines} == {expected}
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


# ---- a lost node -----------------------------------------------------------------------------------


def test_a_lost_node_s_engines_are_placed_again_when_a_node_joins(big):
    fleet, weights = big.fleet, big.weights
    whole(big)
    by_node = Counter(node_of(e) for e in fleet.engines)
    gone = min((ip for ip in by_node if ip != big.ips[0]), key=lambda ip: (by_node[ip], ip))
    lost = [e for e in fleet.engines if node_of(e) == gone]
    lost_ids = {e.engine_id for e in lost}
    survivors = [e for e in fleet.engines if e not in lost]
    old_pids = [next(ev.details["pid"] for ev in reversed(events_of(big, e.engine_id))
                     if ev.kind in (S.LOADED, S.STALE) and "pid" in ev.details) for e in lost]
    seen: list[tuple] = []  # (event, routed at that moment) of the lost node and its engines

    def watch(event) -> None:
        if event.subject in lost_ids or event.subject == f"node/{gone}":
            e = next((x for x in lost if x.engine_id == event.subject), None)
            routed = e is not None and e.url is not None and e.url in routed_urls(fleet)
            seen.append((event, routed))

    fleet.subscribe(watch)
    rounds = Rounds(fleet, ROUND_PARAMS, prompts=big.n, n=2).start()
    try:
        node = next(x for x in big.cluster.worker_nodes if x.node_ip_address == gone)
        big.cluster.remove_node(node, allow_graceful=False)
        wait_until(lambda: {ev.subject for ev, _ in seen
                            if ev.kind is Happening.WAITING_FOR_CAPACITY} == lost_ids,
                   60, "the fleet to say it runs smaller")
        node_lost = [ev for ev, _ in seen if ev.kind is Happening.NODE_LOST]
        assert len(node_lost) == 1 and node_lost[0].details["engines"] == sorted(lost_ids)
        assert not any(running(pid) for pid in old_pids)
        # The run goes on with the survivors: a round ends, a push lands on them alone.
        rounds.wait_rounds(1, 120, "a round on the survivors")
        report = weights.push(big.model)
        reached = [e for e in survivors if e.url in report["engines"]]
        assert reached and {e.handle.weight_version() for e in reached} == {str(fleet.version)}
        # a survivor the push left out (its answer past the deadline on a loaded machine) is
        # out of the router until its resync brings it to this version
        assert not {e.url for e in survivors if e not in reached} & routed_urls(fleet)
        assert {fleet.states()[i] for i in lost_ids} == {S.RELAUNCHING.value}
        # A node joins: the engines are placed there and brought to the fleet's version.
        new_node = big.next_ip()
        big.cluster.add_node(num_cpus=2 * len(lost), num_gpus=len(lost),
                             node_ip_address=new_node)
        wait_until(lambda: {fleet.states()[i] for i in lost_ids} == {S.REGISTERED.value},
                   240, "the engines back on the new node")
        rounds.wait_rounds(1, 120, "a round with every engine")
        wait_all_registered(fleet)
        assert {e.handle.weight_version() for e in survivors} == {str(fleet.version)}
    finally:
        results = rounds.stop()

    node_event = next(i for i, (ev, _) in enumerate(seen) if ev.kind is Happening.NODE_LOST)
    for e in lost:
        assert (node_of(e), urlparse(e.url).hostname) == (new_node, new_node)
        big.urls.add(e.url)
        mine = [(i, ev, routed) for i, (ev, routed) in enumerate(seen)
                if ev.subject == e.engine_id]
        kinds = [ev.kind for _, ev, _ in mine]
        # A probe in flight when the node went fails at once: out of the router (SUSPECT)
        # before Ray declares the node dead (the monitor's next round waits for that: its
        # actors' liveness answers nothing meanwhile), so never DEAD before it.
        lead = 1 if kinds[:1] == [S.SUSPECT] else 0
        assert kinds[lead:] == [S.DEAD, S.RELAUNCHING, Happening.WAITING_FOR_CAPACITY,
                                S.STALE, S.UPDATING, S.REGISTERED, Happening.RECOVERED], kinds
        # the node's loss is told once, after the first death, before any relaunch
        assert node_event < mine[lead + 1][0]
        # Routed only once verified at the fleet's version (never at the one it died with).
        assert [routed for _, ev, routed in mine if ev.is_state_change] == \
            [False] * (4 + lead) + [True]
        assert mine[-2][1].details["version"] == str(fleet.version)
    assert seen[0][0].kind in (S.SUSPECT, S.DEAD) and seen[0][1] is False and node_event > 0
    for samples in results:
        assert Counter(s.prompt_index for s in samples) == {i: 2 for i in range(big.n)}
        assert all(len(s.output_ids) == MAX_NEW for s in samples)
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


# ---- the end -------------------------------------------------------------------------------------


def test_every_engine_serves_the_final_version_and_every_sample_comes_back_once(big):
    fleet = big.fleet
    whole(big)
    big.weights.push(big.model)
    final = str(fleet.version)
    assert len(fleet.engines) == big.n
    assert {e.handle.weight_version() for e in fleet.engines} == {final}
    assert routed_urls(fleet) == {e.url for e in fleet.engines}
    prompts, n = [[7, 1 + i, 9] for i in range(big.n)], 2
    samples = fleet.generate(prompts, n, {"temperature": 1.0, "max_new_tokens": 8,
                                          "ignore_eos": True})
    assert len(samples) == len(prompts) * n
    assert Counter(s.prompt_index for s in samples) == {i: n for i in range(len(prompts))}
    assert all(len(s.output_ids) == 8 and s.weight_version == final for s in samples)
    # Each engine's own record of what it served: every engine served some of them, each
    # at the final version, and every sample was served once.
    rids = {s.meta["id"] for s in samples}
    assert len(rids) == len(samples)

    def served() -> dict[str, list]:
        out = {}
        for e in fleet.engines:
            path = Path(fleet.log_dir) / (e.engine_id.replace("/", "-") + ".served.jsonl")
            out[e.engine_id] = [x for x in read_served(path) if x.rid in rids] \
                if path.exists() else []
        return out

    wait_until(lambda: sum(len(v) for v in served().values()) >= len(rids), 30,
               "the engines' served logs")
    by_engine = served()
    assert all(by_engine.values()), {k: len(v) for k, v in by_engine.items()}
    lines = [x for v in by_engine.values() for x in v]
    assert sorted(x.rid for x in lines) == sorted(rids)
    assert {x.version for x in lines} == {final}


def test_nothing_is_left_behind(big):
    big.weights.close()
    big.fleet.shutdown()
    big.closed = True
    pids = server_pids(big)
    # one server per launch: the fleet's, each added engine's and each relaunch's
    launches = big.n + sum(1 for ev in big.events
                           if (ev.kind is S.LAUNCHING and ev.details.get("added"))
                           or ev.kind is S.RELAUNCHING)
    assert len(pids) == launches
    wait_until(lambda: not any(running(p) for p in pids.values()), 30,
               "every engine server to exit")
    assert all(refused(url) for url in big.urls), big.urls
    assert not big.fleet.placement.added and big.fleet.placement.pg is None
    # every engine's port and the router's free to bind again
    for url in [*big.urls, big.router.geturl()]:
        u = urlparse(url)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((u.hostname, u.port))  # raises if something still listens there
