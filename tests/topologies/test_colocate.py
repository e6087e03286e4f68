"""configs/colocate_cpu.yaml end to end: the trainer and a reference engine share one
bundle. Around each train step the engine releases its memory, weights dropped (no host
backup), and resumes it (OFFLOADED: out of the router, probed with /ping), stays out of the
router until the sync that follows refills its weights (so the sync does not pause it),
and weights go over the `tensor` transport (shared memory on CPU)."""

from __future__ import annotations

from slime_like.fleet.offload import HELD_FOR_SYNC
from tests.topologies.job_checks import check_run, no_process_outlives, run_job, timeline

STEPS = 3
ENGINE = "default/g0/e0"


def test_colocated_engine_gives_its_memory_back_around_each_train_step(tmp_path, fresh_ray):
    run_job(tmp_path, "configs/colocate_cpu.yaml", "--num-rollout", str(STEPS))
    ms = check_run(tmp_path, STEPS, [ENGINE])
    assert all(m["engines_offloaded"] == [ENGINE] for m in ms), [m.get("engines_offloaded")
                                                                 for m in ms]
    assert all(m["sync_transport"] == "tensor" for m in ms), ms[-1]
    # the engine was held out of the router from its resume to the sync: never paused
    assert all(m["sync_not_paused"] == 1 for m in ms), [m.get("sync_not_paused") for m in ms]
    # CPU trainer: --offload-train (implied by --colocate) has no device memory to free
    assert all(m["trainer_offloaded"] is False for m in ms)
    # each step split into its phases; without a weights backup the engine's release and
    # resume move nothing over the host link (the sync refills the weights)
    for m in ms:
        for key in ("rollout_s", "score_s", "check_s", "engine_release_s", "train_s",
                    "engine_resume_s", "sync_s", "step_s"):
            assert isinstance(m.get(key), int | float), (key, m)
        assert m["step_s"] >= m["rollout_s"] + m["train_s"] + m["sync_s"], m
        assert "engine_release_gbps" not in m and "engine_resume_gbps" not in m, m
        assert m["sync_requests"] >= 1 and isinstance(m["sync_detail_ms"], dict), m
    events = [e for e in timeline(tmp_path) if e["engine"] == ENGINE]
    offloads = [e for e in events if e["state"] == "OFFLOADED"]
    assert len(offloads) == STEPS
    # each offload is followed by a resume that keeps it out of the router (STALE) until the
    # sync right after the train step routes it at the new version
    for e in offloads:
        held, updating, routed = events[events.index(e) + 1:events.index(e) + 4]
        assert held["state"] == "STALE" and held["reason"] == HELD_FOR_SYNC, held
        assert updating["state"] == "UPDATING", updating
        assert routed["state"] == "REGISTERED", routed
        assert routed["version"] == updating["version"], (updating, routed)
    # the release and resume around every train step are routine: not in the report's table
    report = (tmp_path / "report.md").read_text()
    assert "- step phases (median): generation" in report, report
    assert "| OFFLOADED |" not in report and f"| {ENGINE} | REGISTERED |" not in report, report
    no_process_outlives(tmp_path)
