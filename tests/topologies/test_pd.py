"""configs/pd_cpu.yaml end to end: a prefill and a decode reference engine behind the real
sglang-router in PD mode; the decode engine's log-probabilities equal the trainer's, and
every weight sync reaches both engines."""

from __future__ import annotations

from tests.topologies.job_checks import check_run, no_process_outlives, run_job, timeline

STEPS = 3
PREFILL, DECODE = "actor/g0/e0", "actor/g1/e1"


def test_pd_job_generates_through_the_pd_router_and_syncs_both_sides(tmp_path, fresh_ray):
    run_job(tmp_path, "configs/pd_cpu.yaml", "--num-rollout", str(STEPS))
    check_pd_job(tmp_path)


def check_pd_job(tmp_path) -> None:
    """The PD run's checks, whichever router ran it (tests/topologies/test_smg.py: smg)."""
    ms = check_run(tmp_path, STEPS, [PREFILL, DECODE])
    events = timeline(tmp_path)
    router = [e for e in events if e["engine"] == "router/actor" and e["state"] == "READY"]
    assert router, "no router for the model"
    # every full update took both engines along: one verified REGISTERED per version each
    for engine in (PREFILL, DECODE):
        versions = [int(e["version"]) for e in events if e["engine"] == engine
                    and e["state"] == "REGISTERED" and "version" in e]
        assert versions == list(range(1, ms[-1]["weight_version"] + 1)), (engine, versions)
    # the router ran in PD mode in front of a prefill engine (with its bootstrap port) and a
    # decode engine: a PD router answers only through both (tests/reference_engine/test_pd.py
    # checks the hand-off itself)
    logs = tmp_path / "logs"
    argv = {name: (logs / f"{name}.log").read_text(errors="replace").splitlines()[0]
            for name in ("router-actor", "actor-g0-e0", "actor-g1-e1")}
    assert "--pd-disaggregation" in argv["router-actor"]
    assert "--disaggregation-mode prefill" in argv["actor-g0-e0"]
    assert "--disaggregation-bootstrap-port" in argv["actor-g0-e0"]
    assert "--disaggregation-mode decode" in argv["actor-g1-e1"]
    no_process_outlives(tmp_path)
