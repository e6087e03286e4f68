"""Elastic membership on the real fleet: engines added and drained while requests run.

Real Ray with simulated nodes (`ray.cluster_utils.Cluster`), the real sglang-router and
reference engines whose forward steps take 40 ms (so a request runs ~2 s). One fleet for
the module, pushed version 1 by `FleetWeights`: eight engines over two nodes (four GPUs
each) in CI, 64 engines over eight nodes (eight each) under `-m slow`; then

- a node joins and `add_engines(1)` places the new engine there (a placement group of its
  own, waiting for that capacity: every GPU of the nodes is taken), launches it after the
  command, resyncs it while the others serve and routes it only once it is verified at the
  fleet's version;
- `drain` of engine 0 with a deadline (0.3 s) far shorter than its running requests: they
  are moved (aborted, continued elsewhere as prompt + partial output), none lost or doubled;
  it leaves the weight group at the next push's regroup, then stops;
- `slime-like fleet scale RUN_DIR --engines N` against a running `ScaleWatcher` adds an
  engine on the freed bundle and drains it again;
- an engine's server is SIGSTOPped just before a push and left stopped: the push lands on
  the others before the health monitor (on: 2 failed probes of up to 5 s, 1 s apart) calls
  it dead, which the order of the fleet's events shows, and it is relaunched at the
  fleet's version;
- node B is lost (its raylet and every process on it killed, as `Cluster.remove_node`
  does) while requests run: its engines (four, or eight) are seen dead at once, the
  rounds and a weight push go on with the survivors, the fleet says it runs smaller while
  no node has room, and when node D joins the engines are placed there, resynced and
  routed only at the fleet's version;
- nothing is left: every engine process and port of the module is gone after shutdown.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
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
    launch_fleet,
)
from slime_like.job.scaling import ScaleWatcher
from slime_like.models import load_pretrained
from tests.simulated_nodes import simulated_nodes

FLEET_YAML = Path(__file__).resolve().parents[2] / "examples" / "own_trainer" / "fleet.yaml"
MAX_NEW = 48
PARAMS = {"max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True}
S = EngineState


@dataclass(frozen=True)
class FleetSize:
    """The module's fleet: `nodes` simulated nodes of `per_node` GPUs, one engine on each
    GPU; the node that joins for the add (C) and for the lost node's engines (D) come after
    them. Each generation round asks two samples of `prompts` prompts."""

    nodes: int
    per_node: int

    @property
    def engines(self) -> int:
        return self.nodes * self.per_node

    @property
    def ips(self) -> list[str]:
        return [f"127.0.0.{2 + i}" for i in range(self.nodes)]

    @property
    def lost(self) -> str:  # node B
        return self.ips[1]

    @property
    def node_c(self) -> str:
        return f"127.0.0.{2 + self.nodes}"

    @property
    def node_d(self) -> str:
        return f"127.0.0.{3 + self.nodes}"

    @property
    def prompts(self) -> int:
        return max(8, self.engines)


# CI's fleet: 8 engines on two nodes. Under `-m slow`: 64 engines on eight nodes of eight,
# a real cluster's size (about 20 GB of memory and 16 cores: the GPU machine's host).
SIZES = [pytest.param(FleetSize(2, 4), id="8"),
         pytest.param(FleetSize(8, 8), id="64",
                      marks=[pytest.mark.slow, pytest.mark.timeout(900)])]


def wait_until(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.05)


class Rounds:
    """Rounds of generation on a thread until stopped (partial rollout on), every round
    kept for the checks."""

    def __init__(self, fleet, prompts: int = 8, n: int = 2):
        self.fleet, self.n = fleet, n
        self.prompts = [[1 + i, 2 + i, 3 + i] for i in range(prompts)]
        self.rounds: list[list] = []
        self.gen = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Rounds:
        self._thread.start()
        wait_until(lambda: self.gen is not None, what="the generator")
        return self

    def _run(self) -> None:
        try:
            with self.fleet.generator(keep_mixed_versions=True, partial_rollout=True) as gen:
                self.gen = gen
                while not self._stop.is_set():
                    self.rounds.append(gen.generate(self.prompts, self.n, PARAMS))
        except BaseException as err:  # noqa: BLE001 - raised by stop()
            self.error = err

    def stop(self) -> list[list]:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "a generation round never ended"
        if self.error is not None:
            raise self.error
        return self.rounds


def events_of(state, engine_id: str) -> list:
    return [e for e in state.events if e.subject == engine_id]


def server_pids(state) -> dict[str, int]:
    """Every engine server of the module, by engine id and launch, from the events that
    name one (LOADED, and STALE after a relaunch)."""
    return {f"{e.subject}@{i}": e.details["pid"] for i, e in enumerate(state.events)
            if e.kind in (S.LOADED, S.STALE) and "pid" in e.details}


def running(pid: int) -> bool:
    """A live process (a zombie waiting for its reaper is gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def refused(url: str) -> bool:
    u = urlparse(url)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((u.hostname, u.port)) != 0


@pytest.fixture(scope="module", params=SIZES)
def elastic(request, tmp_path_factory, tiny_model_dir):
    size: FleetSize = request.param
    events: list = []
    work = tmp_path_factory.mktemp("elastic")
    fleet_yaml = work / "fleet.yaml"  # the example's model, one engine per GPU of the nodes
    fleet_yaml.write_text(FLEET_YAML.read_text().replace("num_gpus: 2",
                                                         f"num_gpus: {size.engines}"))
    with simulated_nodes(size.ips, cpus=size.per_node, gpus=size.per_node,
                         node_death_s=4) as cluster:
        fleet = launch_fleet(fleet_yaml, model_path=tiny_model_dir,
                             engine=EngineSettings(program="reference", reference_min_step_ms=40),
                             health=HealthSettings(enabled=True, interval_s=1.0, timeout_s=5.0,
                                                   first_wait_s=3.0, failure_threshold=2),
                             log_dir=work / "logs", on_event=events.append)
        state = SimpleNamespace(fleet=fleet, cluster=cluster, events=events, closed=False,
                                urls=set(), relaunched=[], size=size)
        try:
            state.model = load_pretrained(tiny_model_dir, dtype=torch.float32)
            state.weights = FleetWeights(fleet, transport="distributed")
            state.weights.push(state.model)
            yield state
        finally:
            if not state.closed:
                fleet.shutdown()


def test_engines_added_and_drained_while_requests_run(elastic):
    fleet, weights, size = elastic.fleet, elastic.weights, elastic.size
    first = {e.engine_id for e in fleet.engines}
    elastic.urls |= {e.url for e in fleet.engines}
    seen: list[tuple] = []  # (event, routed at that moment) of the added engine

    def watch(event) -> None:
        if event.subject.startswith("policy/") and event.subject not in first:
            e = next((x for x in fleet.engines if x.engine_id == event.subject), None)
            routed = e is not None and e.url is not None and e.url in routed_urls(fleet)
            seen.append((event, routed))

    fleet.subscribe(watch)
    rounds = Rounds(fleet, size.prompts).start()
    try:
        assert Counter(e.placements[0].node_ip for e in fleet.engines) == {
            ip: size.per_node for ip in size.ips}
        # The add waits for capacity (every GPU of the nodes is taken) until node C joins.
        asked = time.time()
        added: list[str] = []
        adding = threading.Thread(target=lambda: added.extend(fleet.add_engines(1)))
        adding.start()
        time.sleep(0.5)
        assert not added and adding.is_alive()
        elastic.cluster.add_node(num_cpus=1, num_gpus=1, node_ip_address=size.node_c)
        adding.join(timeout=180)
        assert not adding.is_alive() and len(added) == 1
        new = fleet.find(added[0])
        assert (new.placements[0].node_ip, new.placements[0].placement_group) == (size.node_c, 1)
        assert urlparse(new.url).hostname == size.node_c
        elastic.urls.add(new.url)
        # Launched after the command; routed only once verified at the fleet's version.
        loaded = next(ev for ev, _ in seen if ev.kind is S.LOADED)
        assert psutil.Process(loaded.details["pid"]).create_time() >= asked - 0.5
        kinds = [ev.kind for ev, _ in seen if ev.is_state_change]
        assert kinds == [S.LAUNCHING, S.LOADED, S.STALE, S.UPDATING, S.REGISTERED], kinds
        assert [routed for ev, routed in seen if ev.is_state_change] == [False] * 4 + [True]
        assert seen[-1][0].details["version"] == str(fleet.version) == "1"
        assert new.handle.weight_version() == "1"

        # Drain engine 0 just after a round started: its requests run ~2 s, the deadline
        # is 0.3 s, so they are moved.
        e0 = fleet.find("policy/g0/e0")
        e0_url = e0.url
        started = len(rounds.rounds)
        wait_until(lambda: len(rounds.rounds) > started, 120, "a round to end")
        wait_until(lambda: (e0.handle.in_flight() or 0) > 0, 30, "requests on engine 0")
        report = fleet.drain([e0.engine_id], deadline_s=0.3)
        assert report.moved > 0, report
        assert report.waiting_for_regroup == (e0.engine_id,)  # in the weight group of v1
        assert fleet.states()[e0.engine_id] == S.DRAINING.value
        assert e0_url not in routed_urls(fleet)
        wait_until(lambda: len(rounds.rounds) > started + 1, 120, "the drained round to end")
    finally:
        results = rounds.stop()

    # Every round: each requested sample back exactly once, whole.
    for samples in results:
        assert len(samples) == 2 * size.prompts
        assert Counter(s.prompt_index for s in samples) == {i: 2 for i in range(size.prompts)}
        assert all(len(s.output_ids) == MAX_NEW and s.finish_reason == "length"
                   for s in samples)
    moved = [s for r in results for s in r if s.partial_resubmits]
    assert moved and rounds.gen.aborted > 0  # continued elsewhere, prompt + partial output

    # The next push regroups without engine 0: it leaves the group, then stops.
    joined = weights.sync.transport.asked[e0_url]  # its session: the groups it joined
    assert joined.groups
    weights.push(elastic.model)
    wait_until(lambda: e0.engine_id not in fleet.states(), 60, "engine 0 to stop")
    e0_events = events_of(elastic, e0.engine_id)
    assert [ev.kind for ev in e0_events[-3:]] == [S.DRAINING, Happening.DRAINED, S.STOPPED]
    version_2 = next(ev for ev in elastic.events if ev.kind is Happening.VERSION
                     and ev.details["version"] == "2")
    assert e0_events[-1].at >= version_2.at
    # It was asked to leave the old group (on the engine pool, not waited for: an engine
    # that left the membership may be dead) and did.
    wait_until(lambda: not joined.groups, 30, "engine 0 to leave the old group")
    pid = next(ev.details["pid"] for ev in e0_events if ev.kind is S.LOADED)
    wait_until(lambda: not running(pid), 30, "engine 0's server to exit")
    assert refused(e0_url)
    assert set(fleet.states().values()) == {S.REGISTERED.value}
    assert {e.handle.weight_version() for e in fleet.engines} == {"2"}
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


def _scale(run_dir: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "slime_like.cli", "fleet", "scale",
                          str(run_dir), *args, "--wait", "120"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_scale_command_resizes_the_running_fleet(elastic, tmp_path):
    fleet, size = elastic.fleet, elastic.size
    watcher = ScaleWatcher(fleet, tmp_path, poll_s=0.1).start()
    try:
        grown = _scale(tmp_path, "--engines", str(size.engines + 1))
        assert grown["ok"] and grown["before"] == size.engines and len(grown["added"]) == 1, grown
        new = fleet.find(grown["added"][0])
        elastic.urls.add(new.url)
        # the bundle engine 0 gave back, in the job's own placement group
        assert new.placements[0].placement_group == 0
        assert new.placements[0].node_ip in size.ips
        assert new.handle.weight_version() == str(fleet.version)
        shrunk = _scale(tmp_path, "--engines", str(size.engines), "--drain-deadline", "5")
        # the newest engine; resynced over its own group, it is in no group to leave
        assert [d["engine"] for d in shrunk["drained"]] == [new.engine_id], shrunk
        assert shrunk["waiting_for_regroup"] == []
        assert new.engine_id not in fleet.states()
    finally:
        watcher.stop()
    assert not (tmp_path / "scale" / "job.json").exists()
    elastic.weights.push(elastic.model)
    # an engine this push left out as hung on a loaded machine is resynced first
    wait_all_registered(fleet)
    assert {e.handle.weight_version() for e in fleet.engines} == {str(fleet.version)}


def test_a_push_lands_on_the_others_before_the_monitor_calls_a_stopped_engine_dead(elastic):
    fleet, weights = elastic.fleet, elastic.weights
    for _ in range(3):  # every call type answered lately: the sync's deadlines have a basis
        weights.push(elastic.model)
    wait_all_registered(fleet)  # an engine a warm-up push found slow is resynced first
    hung = fleet.find("policy/g0/e1")
    others = [e for e in fleet.engines if e is not hung]
    pid = ray.get(hung.actors[0].server_pid.remote())
    expected = fleet.version.next().wire
    events = recorder(fleet)
    with stopped(pid):  # just before the push, as a wedged host or a debugger would
        report = weights.push(elastic.model)
        landed = check_landed_while_suspect(fleet, events, hung, others, report, expected)
        wait_all_registered(fleet)  # the monitor's verdict, then a new server, resynced
    dead = first(events, subject=hung.engine_id, kind=S.DEAD)
    assert dead is not None and dead > landed, events
    assert "consecutive failed probes" in str(events[dead].details.get("reason")), events[dead]
    assert first(events, dead, subject=hung.engine_id, kind=Happening.RECOVERED) is not None
    assert not running(pid)
    elastic.relaunched.append(hung.engine_id)
    assert {e.handle.weight_version() for e in fleet.engines} == {expected}
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


def test_a_lost_node_s_engines_are_placed_again_when_a_node_joins(elastic):
    fleet, weights, size = elastic.fleet, elastic.weights, elastic.size
    lost = [e for e in fleet.engines if e.placements[0].node_ip == size.lost]
    survivors = [e for e in fleet.engines if e not in lost]
    assert len(lost) >= size.per_node - 1 and survivors  # (the scale test's engine may be on B)
    lost_ids = {e.engine_id for e in lost}
    elastic.relaunched += sorted(lost_ids)
    old_pids = {e.engine_id: next(ev.details["pid"] for ev in reversed(events_of(
        elastic, e.engine_id)) if ev.kind is S.LOADED) for e in lost}
    seen: dict[str, list[tuple]] = {i: [] for i in lost_ids}  # (event, routed then)
    node_events: list = []

    def watch(event) -> None:
        if event.subject == f"node/{size.lost}":
            node_events.append(event)
        elif event.subject in lost_ids:
            e = fleet.find(event.subject)
            seen[event.subject].append((event, e.url is not None and e.url in routed_urls(fleet)))

    fleet.subscribe(watch)
    rounds = Rounds(fleet, size.prompts).start()
    try:
        node_b = next(n for n in elastic.cluster.worker_nodes if n.node_ip_address == size.lost)
        elastic.cluster.remove_node(node_b, allow_graceful=False)
        wait_until(lambda: all(any(ev.kind is Happening.WAITING_FOR_CAPACITY for ev, _ in s)
                               for s in seen.values()), 60, "the fleet to say it runs smaller")
        node_lost = next(ev for ev in node_events if ev.kind is Happening.NODE_LOST)
        assert sorted(node_lost.details["engines"]) == sorted(lost_ids)  # every one at once
        assert not any(running(pid) for pid in old_pids.values())
        # The run goes on with the survivors: a round ends, a push lands on them alone.
        done = len(rounds.rounds)
        wait_until(lambda: len(rounds.rounds) > done, 120, "a round on the survivors")
        weights.push(elastic.model)
        assert {e.handle.weight_version() for e in survivors} == {str(fleet.version)}
        assert {fleet.states()[i] for i in lost_ids} == {S.RELAUNCHING.value}
        # A node joins: the engines are placed there and brought to the fleet's version.
        elastic.cluster.add_node(num_cpus=size.per_node, num_gpus=size.per_node,
                                 node_ip_address=size.node_d)
        wait_until(lambda: all(fleet.states()[i] == S.REGISTERED.value for i in lost_ids),
                   180, "the engines back on node D")
        done = len(rounds.rounds)
        wait_until(lambda: len(rounds.rounds) > done, 120, "a round with every engine")
    finally:
        results = rounds.stop()

    for e in lost:
        assert (e.placements[0].node_ip, urlparse(e.url).hostname) == (size.node_d, size.node_d)
        elastic.urls.add(e.url)
        kinds = [ev.kind for ev, _ in seen[e.engine_id]]
        if kinds[0] is S.SUSPECT:  # a probe past its deadline may come before the death
            kinds = kinds[1:]
        assert kinds[:3] == [S.DEAD, S.RELAUNCHING, Happening.WAITING_FOR_CAPACITY], kinds
        assert kinds[3:] == [S.STALE, S.UPDATING, S.REGISTERED, Happening.RECOVERED], kinds
        # Routed only once verified at the fleet's version (never at the one it died with).
        changes = [routed for ev, routed in seen[e.engine_id] if ev.is_state_change]
        assert changes[-1] and not any(changes[:-1]), (e.engine_id, changes)
        assert seen[e.engine_id][-2][0].details["version"] == str(fleet.version)
    for samples in results:
        assert Counter(s.prompt_index for s in samples) == {i: 2 for i in range(size.prompts)}
        assert all(len(s.output_ids) == MAX_NEW for s in samples)
    assert routed_urls(fleet) == {e.url for e in fleet.engines}


def test_nothing_is_left_behind(elastic):
    elastic.weights.close()
    elastic.fleet.shutdown()
    elastic.closed = True
    pids = server_pids(elastic)
    # those of the launch, one added per scenario, the stopped one and the lost node's
    assert len(pids) == elastic.size.engines + 2 + len(elastic.relaunched), pids
    wait_until(lambda: not any(running(p) for p in pids.values()), 30,
               "every engine server to exit")
    assert all(refused(url) for url in elastic.urls), elastic.urls
    assert not elastic.fleet.placement.added and elastic.fleet.placement.pg is None
