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

from tests.hosts.cluster import REPO, VENV_BIN, RayOnHosts, start_engine, wait_healthy
from tests.hosts.conftest import require_hosts
from tests.hosts.harness import CLUSTER_IF, DECOY_IF, Hosts, leftovers
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
        h.ssh(a, "(sleep 600 > /dev/null 2>&1 < /dev/null &)")
        assert any(c.startswith("sleep 600") for c in h.processes(a))
        assert h.ssh(b, "pgrep -x sleep || true").stdout == ""  # its own PID namespace
        assert h.addresses(a) == {"lo": ["127.0.0.1"], CLUSTER_IF: [a.ip], DECOY_IF: [a.decoy_ip]}
        sleeper = [p for p in psutil.process_iter(["cmdline"])
                   if (p.info["cmdline"] or [])[:2] == ["sleep", "600"]]
        raise RuntimeError("the test failed")
    assert leftovers(h.owner) == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in sleeper)


def test_run_cluster_starts_every_host_and_a_job_spans_them(hosts, tmp_path):
    ray = RayOnHosts(hosts, tmp_path)
    run_dir = tmp_path / "run"
    try:
        r = ray.start(GLOO_SOCKET_IFNAME=CLUSTER_IF)
        assert r.returncode == 0, r.stderr[-3000:]
        token = ray.token.read_text()
        for h in hosts.hosts:  # scp put the one token in each host's own home
            assert (h.home / ".slime_like" / "ray_token").read_text() == token, h.hostname
        ray.wait_nodes(len(hosts.hosts))

        rc, out = ray.run_job(run_dir, *JOB, "--num-rollout", "4")
        assert rc == 0, out[-5000:]
        check_run(run_dir, 4, ENGINES)  # the log-probability check held at every step
        where = check_on_cluster_interface(hosts, run_dir)
        trainer_host, *engine_hosts = (h.ip for h in hosts.hosts)
        assert sorted(where[e] for e in ENGINES) == engine_hosts, where
        assert where["router/default"] in (trainer_host, *engine_hosts)
        check_weight_group_on_cluster_interface(run_dir, where, trainer_host)
    finally:
        stop = ray.stop()
        left = ray.wait_no_processes()
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert left == [[]] * len(hosts.hosts), f"processes outlived run_cluster.sh stop: {left}"


def check_weight_group_on_cluster_interface(run_dir: Path, where: dict[str, str],
                                            trainer_host: str) -> None:
    """Each engine's rank of the weight group bound its host's cluster address and reached
    the trainer's store from it (its own log says so, at every join)."""
    for engine in ENGINES:
        log = (run_dir / "logs" / f"{engine.replace('/', '-')}.log").read_text()
        assert f"binds {where[engine]} on {CLUSTER_IF} (GLOO_SOCKET_IFNAME={CLUSTER_IF}); " \
               f"the trainer's store {trainer_host}:" in log, log[-2000:]


@pytest.mark.slow
def test_an_engine_killed_on_its_host_is_relaunched_there_and_the_job_goes_on(hosts, tmp_path):
    ray = RayOnHosts(hosts, tmp_path)
    run_dir = tmp_path / "run"
    h2 = hosts.hosts[2]
    try:
        assert ray.start(GLOO_SOCKET_IFNAME=CLUSTER_IF).returncode == 0
        ray.wait_nodes(len(hosts.hosts))
        job = ray.start_job(run_dir, *JOB, "--num-rollout", "20")
        try:
            wait_for_step(run_dir, 3, job)
            # a real SIGKILL of the engine's server, on its own host
            killed = hosts.ssh(h2, "pkill -9 -f -e 'slime_like.reference_engine'", check=False)
            assert killed.returncode == 0, killed
            rc = job.wait(timeout=600)
        finally:
            if job.poll() is None:
                job.kill()
        assert rc == 0, run_dir.with_suffix(".out").read_text()[-5000:]
        check_run(run_dir, 20, ENGINES)
        where = check_on_cluster_interface(hosts, run_dir)
        states = [e["state"] for e in map(json.loads, (run_dir / "engine_timeline.jsonl")
                                          .read_text().splitlines())
                  if e["engine"] == "default/g0/e1"]
        assert "DEAD" in states and "RECOVERED" in states, states
        relaunched = [e["url"] for e in map(json.loads, (run_dir / "engine_timeline.jsonl")
                                            .read_text().splitlines())
                      if e["engine"] == "default/g0/e1" and "url" in e]
        assert {urlparse(u).hostname for u in relaunched} == {h2.ip}, relaunched
        check_weight_group_on_cluster_interface(run_dir, where, hosts.hosts[0].ip)
    finally:
        stop = ray.stop()
        left = ray.wait_no_processes()
    assert stop.returncode == 0 and left == [[]] * len(hosts.hosts), (stop.stderr, left)


@pytest.mark.slow
def test_a_short_partition_of_an_engine_host_is_survived(hosts, tmp_path):
    ray = RayOnHosts(hosts, tmp_path)
    run_dir = tmp_path / "run"
    h2 = hosts.hosts[2]
    try:
        assert ray.start(GLOO_SOCKET_IFNAME=CLUSTER_IF).returncode == 0
        ray.wait_nodes(len(hosts.hosts))
        job = ray.start_job(run_dir, *JOB, "--num-rollout", "20")
        try:
            wait_for_step(run_dir, 3, job)
            hosts.set_link(h2, up=False)  # its processes live on, cut off
            try:
                time.sleep(PARTITION_S)
            finally:
                hosts.set_link(h2, up=True)
            rc = job.wait(timeout=600)
        finally:
            if job.poll() is None:
                job.kill()
        out = run_dir.with_suffix(".out").read_text()
        assert rc == 0, out[-5000:]
        check_run(run_dir, 20, ENGINES)  # no sample lost or doubled; every check held
        events = [json.loads(x) for x in (run_dir / "engine_timeline.jsonl").read_text()
                  .splitlines()]
        mine = [e for e in events if e["engine"] == "default/g0/e1"]
        # Shorter than the probes' verdict and Ray's node-death timeout: resynced, not replaced.
        assert not {"DEAD", "RELAUNCHING"} & {e["state"] for e in mine}, mine
        # Routed again only at the fleet's version of that moment.
        version = None
        for e in events:
            if e["engine"] == "fleet" and e["state"] == "VERSION":
                version = e["version"]
            elif e["engine"] == "default/g0/e1" and e["state"] == "REGISTERED" \
                    and "version" in e:
                assert str(e["version"]) == str(version), (e, version)
    finally:
        stop = ray.stop()
        left = ray.wait_no_processes()
    assert stop.returncode == 0 and left == [[]] * len(hosts.hosts), (stop.stderr, left)


@pytest.mark.slow
def test_a_long_partition_becomes_a_node_loss_and_leaves_nothing_on_the_healed_host(
        hosts, tmp_path):
    ray = RayOnHosts(hosts, tmp_path)
    run_dir = tmp_path / "run"
    h2 = hosts.hosts[2]
    try:
        assert ray.start(GLOO_SOCKET_IFNAME=CLUSTER_IF).returncode == 0
        ray.wait_nodes(len(hosts.hosts))
        job = ray.start_job(run_dir, *JOB, "--num-rollout", "40")
        try:
            wait_for_step(run_dir, 3, job)
            hosts.set_link(h2, up=False)
            try:
                time.sleep(LONG_PARTITION_S)
            finally:
                hosts.set_link(h2, up=True)
            # Ray declared the node dead meanwhile: its raylet exits once it hears so, and
            # takes every process of the job on that host with it (Ray's log monitor stays
            # until `run_cluster.sh stop`, which the end of this test checks).
            t0 = time.monotonic()
            while any(x in c for c in hosts.processes(h2)
                      for x in ("slime_like", "ray::", "raylet", "default_worker")):
                assert time.monotonic() - t0 < 90, hosts.processes(h2)
                time.sleep(1)
            rc = job.wait(timeout=600)
        finally:
            if job.poll() is None:
                job.kill()
        out = run_dir.with_suffix(".out").read_text()
        assert rc == 0, out[-5000:]
        check_run(run_dir, 40, ENGINES[:1])  # trained on with the engine it could reach
        assert "engine default/g0/e1 is dead: 2 consecutive failed probes" in out
        mine = [json.loads(x)["state"] for x in (run_dir / "engine_timeline.jsonl")
                .read_text().splitlines() if json.loads(x)["engine"] == "default/g0/e1"]
        # out of the router at its first failed probe, and never routed again
        assert "SUSPECT" in mine and "REGISTERED" not in mine[mine.index("SUSPECT"):], mine
    finally:
        stop = ray.stop()
        left = ray.wait_no_processes()
    assert stop.returncode == 0 and left == [[]] * len(hosts.hosts), (stop.stderr, left)


LONG_PARTITION_S = 60.0
PARTITION_S = 12.0


def wait_for_step(run_dir: Path, step: int, job, timeout_s: float = 300) -> None:
    """Until the run's metrics record `step`; fails at once if the job ended first."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) > step):
        assert job.poll() is None, run_dir.with_suffix(".out").read_text()[-4000:]
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s:.0f} s"
        time.sleep(0.5)


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
