"""Multi-node for real: hosts with their own network stacks (tests/hosts/harness.py), Ray
started on them by scripts/run_cluster.sh over ssh, and the job submitted from outside
with the cluster's token, the trainer on one host and an engine on each of the others.

The commands are the README's (Multi-node). Every host has a cluster interface (`clu0`)
and a decoy (`decoy0`) no other host reaches: what each part advertised must be on the
cluster interface, and the weight group must form over it.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
import requests

from slime_like.chaos.served import stale_serves
from slime_like.reference_engine.served_log import read_served
from tests.hosts.cluster import REPO, VENV_BIN, job_on_hosts, start_engine, wait_healthy
from tests.hosts.conftest import require_hosts
from tests.hosts.harness import CLUSTER_IF, DECOY_IF, Hosts, leftovers
from tests.hosts.switch import LinkSwitch
from tests.topologies.job_checks import check_run

ENGINES = ["default/g0/e0", "default/g0/e1"]
# configs/multinode_cpu.yaml with an engine per node: one declared GPU per host, the
# trainer's bundle on the first host (bundles sort by IP), an engine on each of the others.
JOB = ("--config", "configs/multinode_cpu.yaml", "--rollout-num-gpus-per-engine", "1")


def advertised(run_dir: Path) -> dict[str, str]:
    """Engine or router name -> the URL it advertised (the fleet's timeline)."""
    out: dict[str, str] = {}
    for line in (run_dir / "engine_timeline.jsonl").read_text().splitlines():
        event = json.loads(line)
        if "url" in event:
            out.setdefault(event["engine"], event["url"])
    return out


def check_on_cluster_interface(hosts: Hosts, run_dir: Path) -> dict[str, str]:
    """Every advertised address is a host's cluster address; name -> that host's IP."""
    where = {}
    for name, url in advertised(run_dir).items():
        ip = urlparse(url).hostname
        host = hosts.host_of(ip)
        assert host is not None and ip == host.ip, \
            f"{name} advertised {url}, not on a host's {CLUSTER_IF} ({[h.ip for h in hosts.hosts]})"
        where[name] = ip
    return where


def test_a_host_sees_only_its_own_processes_and_a_failed_test_leaves_nothing(tmp_path):
    require_hosts()
    h = Hosts(2, tmp_path)
    with pytest.raises(RuntimeError, match="the test failed"), h:
        a, b = h.hosts
        # ssh returns once sleep has exec'd (its comm is "sleep"), not just forked: a forked
        # child still named bash would make the next line race the scheduler.
        h.ssh(a, "(sleep 600 > /dev/null 2>&1 < /dev/null &); "
                 "until pgrep -x sleep > /dev/null; do sleep 0.05; done")
        assert any(c.startswith("sleep 600") for c in h.processes(a))
        assert h.ssh(b, "pgrep -x sleep || true").stdout == ""  # its own PID namespace
        assert h.addresses(a) == {"lo": ["127.0.0.1"], CLUSTER_IF: [a.ip], DECOY_IF: [a.decoy_ip]}
        sleeper = [p for p in psutil.Process(h.hosts[0].init.pid).children(recursive=True)
                   if p.cmdline()[:2] == ["sleep", "600"]]
        assert len(sleeper) == 1, sleeper
        raise RuntimeError("the test failed")
    assert leftovers(h.owner) == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in sleeper)


def test_run_cluster_starts_every_host_and_a_job_spans_them(hosts, tmp_path):
    with job_on_hosts(hosts, tmp_path, 4, *JOB, GLOO_SOCKET_IFNAME=CLUSTER_IF) as run:
        token = run.ray.token.read_text()
        for h in hosts.hosts:  # scp put the one token in each host's own home
            assert (h.home / ".slime_like" / "ray_token").read_text() == token, h.hostname
        run.succeeded()
        check_run(run.run_dir, 4, ENGINES)  # the log-probability check held at every step
        where = check_on_cluster_interface(hosts, run.run_dir)
        trainer_host, *engine_hosts = (h.ip for h in hosts.hosts)
        assert sorted(where[e] for e in ENGINES) == engine_hosts, where
        assert where["router/default"] in (trainer_host, *engine_hosts)
        check_weight_group_on_cluster_interface(run.run_dir, where, trainer_host)


def check_weight_group_on_cluster_interface(run_dir: Path, where: dict[str, str],
                                            trainer_host: str) -> None:
    """Each engine's rank of the weight group bound its host's cluster address and reached
    the trainer's store from it (its own log says so, at every join)."""
    for engine in ENGINES:
        log = (run_dir / "logs" / f"{engine.replace('/', '-')}.log").read_text()
        assert f"binds {where[engine]} on {CLUSTER_IF} (GLOO_SOCKET_IFNAME={CLUSTER_IF}); " \
               f"the trainer's store {trainer_host}:" in log, log[-2000:]


def timeline(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "engine_timeline.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_engine_killed_on_its_host_is_relaunched_there_and_the_job_goes_on(hosts, tmp_path):
    h2 = hosts.hosts[2]
    with job_on_hosts(hosts, tmp_path, 20, *JOB, GLOO_SOCKET_IFNAME=CLUSTER_IF) as run:
        run.wait_for_step(3)
        # a real SIGKILL of the engine's server, on its own host
        killed = hosts.ssh(h2, "pkill -9 -f -e 'slime_like.reference_engine'", check=False)
        assert killed.returncode == 0, killed
        run.succeeded()
        check_run(run.run_dir, 20, ENGINES)
        where = check_on_cluster_interface(hosts, run.run_dir)
        mine = [e for e in timeline(run.run_dir) if e["engine"] == "default/g0/e1"]
        states = [e["state"] for e in mine]
        assert "DEAD" in states and "RECOVERED" in states, states
        relaunched = [e["url"] for e in mine if "url" in e]
        assert {urlparse(u).hostname for u in relaunched} == {h2.ip}, relaunched
        check_weight_group_on_cluster_interface(run.run_dir, where, hosts.hosts[0].ip)


def check_routed_only_at_the_fleet_version(run_dir: Path, engine: str, healed: float) -> None:
    """`engine` was routed (REGISTERED) only at the fleet's version of that moment (the
    timeline), and from the heal on no engine served a request at a version older than the
    fleet's at that time (the engines' own served logs)."""
    version = None
    for e in timeline(run_dir):
        if e["engine"] == "fleet" and e["state"] == "VERSION":
            version = e["version"]
        elif e["engine"] == engine and e["state"] == "REGISTERED" and "version" in e:
            assert str(e["version"]) == str(version), (e, version)
    assert stale_serves(run_dir, since=healed) == []


def served_after(run_dir: Path, engine: str, healed: float) -> list:
    """What `engine` served after the heal (its own served log)."""
    log = run_dir / "logs" / f"{engine.replace('/', '-')}.served.jsonl"
    return [s for s in read_served(log) if s.time > healed]


def check_resynced_not_replaced(run_dir: Path, engine: str, healed: float) -> None:
    """A partition shorter than the probes' verdict and Ray's node-death timeout, whether
    or not it met a weight sync's control calls (then the sync held the engine SUSPECT
    until it answered again): the engine was never DEAD or relaunched, served after the
    heal, and came back only at the fleet's version."""
    mine = [e for e in timeline(run_dir) if e["engine"] == engine]
    assert not {"DEAD", "RELAUNCHING"} & {e["state"] for e in mine}, mine
    assert served_after(run_dir, engine, healed), f"{engine} served nothing after the heal"
    check_routed_only_at_the_fleet_version(run_dir, engine, healed)


def cut_off(url: str) -> bool:
    """Whether `url` cannot be reached from this machine (no answer within 2 s)."""
    try:
        requests.get(url + "/health", timeout=2)
    except requests.RequestException:
        return True
    return False


@pytest.mark.slow
def test_a_short_partition_of_an_engine_host_is_survived(hosts, tmp_path):
    h2 = hosts.hosts[2]
    with job_on_hosts(hosts, tmp_path, PACED_STEPS, *JOB, *PACED,
                      GLOO_SOCKET_IFNAME=CLUSTER_IF) as run:
        run.wait_for_step(3)
        hosts.set_link(h2, up=False)  # its processes live on, cut off
        try:
            time.sleep(PARTITION_S)
        finally:
            hosts.set_link(h2, up=True)
        healed = time.time()
        run.succeeded()
        check_run(run.run_dir, PACED_STEPS, ENGINES)  # no sample lost or doubled; checks held
        check_resynced_not_replaced(run.run_dir, "default/g0/e1", healed)


@pytest.mark.slow
def test_a_chaos_partition_heals_with_no_stale_serve_and_no_sample_lost(hosts, tmp_path):
    """The chaos fault `partition` at a seeded moment, through the hosts' switch: a 12 s
    cut of an engine host. Wherever it lands (a rollout, the step's probe, or the next
    weight sync's pause, which then finds the engine hung and holds it SUSPECT), the
    engine is kept and resynced once its link is back, never relaunched; nothing stale is
    served after the heal and no sample is lost or doubled."""
    with LinkSwitch(hosts) as switch, job_on_hosts(
            hosts, tmp_path, PACED_STEPS, *JOB, *PACED, "--chaos-seed", "5",
            "--chaos-faults", "partition",
            "--chaos-partition-command", switch.command(str(VENV_BIN / "python")),
            "--chaos-partition-seconds", str(PARTITION_S),
            GLOO_SOCKET_IFNAME=CLUSTER_IF) as run:
        cut = switch.wait_for_cut(timeout_s=300, job=run.job)  # the seeded moment came
        engine = {urlparse(u).hostname: e for e, u in advertised(run.run_dir).items()
                  if e in ENGINES}[cut["node"]]
        assert cut_off(advertised(run.run_dir)[engine])  # for real: its server is out of reach
        run.succeeded()  # a chaos run fails on any invariant violation
    chaos = json.loads((run.run_dir / "chaos.json").read_text())
    [fault] = chaos["faults"]
    assert fault["kind"] == "partition" and fault["target"] == engine, (fault, cut)
    assert [c["node_ip"] for c in fault["effect"]] == [cut["node"]], fault
    assert len(switch.cuts) == 1 and cut["healed_at"] - cut["cut_at"] >= PARTITION_S, cut
    assert chaos["violations"] == [] and chaos["samples"] > 20, chaos
    check_run(run.run_dir, PACED_STEPS, ENGINES)  # no sample lost or doubled; checks held
    met_a_sync = [e for e in timeline(run.run_dir) if e["engine"] == engine
                  and "hung during a weight sync" in str(e.get("reason"))]
    print(f"partition of {engine}: " + ("met a weight sync (SUSPECT), " if met_a_sync else "")
          + "resynced, not replaced")
    check_resynced_not_replaced(run.run_dir, engine, cut["healed_at"])


@pytest.mark.slow
def test_a_long_partition_becomes_a_node_loss_and_leaves_nothing_on_the_healed_host(
        hosts, tmp_path):
    h2 = hosts.hosts[2]
    with job_on_hosts(hosts, tmp_path, 40, *JOB, GLOO_SOCKET_IFNAME=CLUSTER_IF) as run:
        run.wait_for_step(3)
        hosts.set_link(h2, up=False)
        try:
            time.sleep(LONG_PARTITION_S)
        finally:
            hosts.set_link(h2, up=True)
        # Ray declared the node dead meanwhile: its raylet exits once it hears so, and
        # takes every process of the job on that host with it (Ray's log monitor stays
        # until `run_cluster.sh stop`, which the context's end checks).
        t0 = time.monotonic()
        while any(x in c for c in hosts.processes(h2)
                  for x in ("slime_like", "ray::", "raylet", "default_worker")):
            assert time.monotonic() - t0 < 90, hosts.processes(h2)
            time.sleep(1)
        run.succeeded()
        check_run(run.run_dir, 40, ENGINES[:1])  # trained on with the engine it could reach
        assert "engine default/g0/e1 is dead: 2 consecutive failed probes" in run.output
        mine = [e["state"] for e in timeline(run.run_dir) if e["engine"] == "default/g0/e1"]
        # out of the router at its first failed probe, and never routed again
        assert "SUSPECT" in mine and "REGISTERED" not in mine[mine.index("SUSPECT"):], mine


LONG_PARTITION_S = 60.0
PARTITION_S = 12.0
# The training goes on during a short partition (the cut engine is out of the router and
# the syncs), so the job must outlast the cut and the engine's resync by steps that route
# to it: decode steps of at least 20 ms make a step take at least 0.25 s (12 tokens), and
# 80 of them at least 20 s, of which at most the first 3 and 14 s (the cut, the resync)
# pass before the engine is back.
PACED = ("--reference-min-step-ms", "20")
PACED_STEPS = 80


def push(hosts: Hosts, model_dir: Path, engines: list[str], *cases: str) -> dict[str, dict]:
    """tests/hosts/push_weights.py on the first host: case name -> its outcome."""
    argv = [str(VENV_BIN / "python"), "-m", "tests.hosts.push_weights", "--model",
            str(model_dir), *(x for e in engines for x in ("--engine", e)),
            *(x for c in cases for x in ("--case", c))]
    r = hosts.ssh(hosts.hosts[0], f"cd {shlex.quote(str(REPO))} && {shlex.join(argv)}",
                  check=False, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {o["case"]: o for o in map(json.loads, r.stdout.splitlines())}


@pytest.mark.slow
def test_a_weight_group_on_the_wrong_interface_fails_in_seconds_naming_it(
        hosts, tiny_model_dir, tmp_path):
    h0, h1, h2 = hosts.hosts
    try:
        right = start_engine(hosts, h1, tiny_model_dir, tmp_path / "h1.log",
                             GLOO_SOCKET_IFNAME=CLUSTER_IF)
        wrong = start_engine(hosts, h2, tiny_model_dir, tmp_path / "h2.log",
                             GLOO_SOCKET_IFNAME=DECOY_IF)
        wait_healthy(right, tmp_path / "h1.log")
        wait_healthy(wrong, tmp_path / "h2.log")
        out = push(hosts, tiny_model_dir, [right], "unset=", f"decoy={DECOY_IF}",
                   "missing=eth9", f"cluster={CLUSTER_IF}")
        # Unset, gloo binds what the host's name resolves to: the cluster address.
        assert out["unset"]["ok"] and out["cluster"]["ok"], out
        log = (tmp_path / "h1.log").read_text()
        assert f"binds {h1.ip} on {CLUSTER_IF} (GLOO_SOCKET_IFNAME={CLUSTER_IF})" in log, log
        # The trainer on the decoy: named in seconds, with what was tried and what to set.
        decoy = out["decoy"]
        assert not decoy["ok"] and decoy["seconds"] < 30, decoy
        for text in (f"bind {h0.decoy_ip} on {DECOY_IF} (GLOO_SOCKET_IFNAME={DECOY_IF})",
                     f"tried {h0.decoy_ip} -> {h1.ip}:30000: no answer in 5 s",
                     f"Set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on "
                     f"(the route to {h1.ip} leaves by {CLUSTER_IF} ({h0.ip}))"):
            assert text in decoy["error"], decoy["error"]
        missing = out["missing"]
        assert not missing["ok"] and "GLOO_SOCKET_IFNAME=eth9 names no interface" in \
            missing["error"] and f"{CLUSTER_IF} ({h0.ip})" in missing["error"], missing
        # An engine on the decoy: its join fails in seconds, and the error names it.
        out = push(hosts, tiny_model_dir, [right, wrong], f"engine_decoy={CLUSTER_IF}")
        bad = out["engine_decoy"]
        assert not bad["ok"] and bad["seconds"] < 30, bad
        assert wrong in bad["error"] and f"bind {h2.decoy_ip} on {DECOY_IF}" in bad["error"] \
            and f"tried {h2.decoy_ip} -> {h0.ip}:" in bad["error"], bad["error"]
    finally:
        for h in (h1, h2):
            hosts.ssh(h, "pkill -f slime_like.reference_engine || true", check=False)
