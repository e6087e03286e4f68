"""The Shepherd Model Gateway (`--router smg`, smg 1.13.0's own binary) in the real job.

The rest of the suite runs sglang-router (the default); these are the smg forms of the
quickstart job, of the chaos router fault and of PD, on one Ray cluster for the module:

- the quickstart job with its router SIGKILLed (the chaos fault, with the outside
  invariant sampler) and an engine killed mid-rollout: smg is relaunched on its port with
  the engines re-added, the replacement engine is routed only at the version the others
  serve, log-probabilities stay exact;
- configs/pd_cpu.yaml through smg in PD mode, with the PD test's own checks.
"""

from __future__ import annotations

import json

import psutil
import pytest
import ray

from tests.topologies.job_checks import metrics, no_process_outlives, run_job, timeline
from tests.topologies.test_pd import STEPS as PD_STEPS
from tests.topologies.test_pd import check_pd_job

SMG = ("--router", "smg")


@pytest.fixture(scope="module")
def fresh_ray():
    """One local Ray cluster for the module's runs (each run starts and stops its own fleet)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def _router_ran_from_smg(run_dir, model: str) -> None:
    info = json.loads((run_dir / "versions.json").read_text())
    assert info["router"] == {"name": "smg", "version": "1.13.0"}
    first = (run_dir / "logs" / f"router-{model}.log").read_text(errors="replace").splitlines()[0]
    assert " -m smg.launch_router " in first, first  # its own module, not a console script


def _no_pid_outlives(run_dir) -> None:
    """smg retitles its process ("smg::router"), so its command line no longer names the run
    folder: every pid the timeline recorded must be gone."""
    pids = [e["pid"] for e in timeline(run_dir) if "pid" in e]
    assert pids and [p for p in pids if psutil.pid_exists(p)] == [], "a process outlived the job"


def test_quickstart_through_smg_survives_a_router_kill_and_an_engine_crash(tmp_path, fresh_ray):
    steps = 6
    run_job(tmp_path, "configs/quickstart.yaml", *SMG, "--router-enable-rl",
            "--num-rollout", str(steps), "--chaos-seed", "7", "--chaos-faults", "kill_router",
            "--simulate-engine-crash-at", "2", "--rollout-health-check-interval", "0.5")
    ms = metrics(tmp_path)
    assert [m["step"] for m in ms] == list(range(steps))
    assert all(m["samples_returned"] == m["samples_requested"] for m in ms)
    assert all(m["logprob_max_abs_diff"] < 1e-4 for m in ms)
    _router_ran_from_smg(tmp_path, "default")
    # the router fault: smg was SIGKILLed, relaunched on its port, both engines re-added,
    # and the outside sampler never saw an engine routed while stale or unreachable
    chaos = json.loads((tmp_path / "chaos.json").read_text())
    assert [f["kind"] for f in chaos["faults"]] == ["kill_router"] and chaos["faults"][0]["effect"]
    # the syncs of the steps before the router's kill paused and continued both engines
    # through smg's RL plane, in one request each (the kill's own step may sync before or
    # after it fires); with one engine left the sessions call it themselves
    killed_at_step = chaos["faults"][0]["step"]
    reached = [m.get("sync_via_rl_plane", {}) for m in ms]
    assert killed_at_step >= 1 and reached[:killed_at_step] == [
        {"pause_generation": 2, "continue_generation": 2}] * killed_at_step, reached
    assert chaos["violations"] == [] and chaos["samples"] > 10
    events = timeline(tmp_path)
    router = [e for e in events if e["engine"] == "router/default"]
    assert [e["state"] for e in router[:3]] == ["READY", "DEAD", "READY"], router
    assert router[2]["url"] == router[0]["url"]
    # both engines re-added: at once, or (relaunched during a sync) by that sync's settle
    assert router[2]["workers"] + router[2]["left_to_sync"] == 2, router[2]
    if router[2]["left_to_sync"]:
        for engine in ("default/g0/e0", "default/g0/e1"):
            assert any(e["engine"] == engine and e["state"] == "REGISTERED"
                       and e["time_s"] >= router[2]["time_s"] for e in events), engine

    # the engine crash: the replacement joined smg only at the fleet's version of that
    # moment, one the other engine was routed at too (a full sync that takes it along
    # routes both in one settle, in either order)
    crashed = [e for e in events if e["engine"] == "default/g0/e0"]
    states = [e["state"] for e in crashed]
    after = states[states.index("DEAD"):]
    assert after[:3] == ["DEAD", "RELAUNCHING", "STALE"], after
    registered = next(e for e in crashed[states.index("STALE"):] if e["state"] == "REGISTERED")
    fleet_version = [e["version"] for e in events if e["engine"] == "fleet"
                     and e["state"] == "VERSION" and e["time_s"] <= registered["time_s"]][-1]
    assert registered["version"] == fleet_version
    assert any(e["engine"] == "default/g0/e1" and e["state"] == "REGISTERED"
               and e.get("version") == fleet_version for e in events)
    assert "recovery of default/g0/e0" in (tmp_path / "report.md").read_text()
    no_process_outlives(tmp_path)
    _no_pid_outlives(tmp_path)


def test_pd_job_through_smg(tmp_path, fresh_ray):
    run_job(tmp_path, "configs/pd_cpu.yaml", *SMG, "--num-rollout", str(PD_STEPS))
    check_pd_job(tmp_path)
    _router_ran_from_smg(tmp_path, "actor")
    _no_pid_outlives(tmp_path)
