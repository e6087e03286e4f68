"""configs/multi_model_cpu.yaml end to end: an updatable model and a frozen reference model,
one router each; the reference's log-probabilities (through its router) give a KL loss, and
its engine, killed mid-run, is recovered without ever being synced."""

from __future__ import annotations

from tests.topologies.job_checks import check_run, no_process_outlives, run_job, states_of, timeline

STEPS = 4


def test_frozen_reference_model_gives_a_kl_term_and_is_recovered(tmp_path, fresh_ray):
    run_job(tmp_path, "configs/multi_model_cpu.yaml", "--num-rollout", str(STEPS),
            "--simulate-engine-crash-at", "1", "--simulate-engine-crash-model", "ref",
            "--kl-coef", "0.5")
    ms = check_run(tmp_path, STEPS, ["actor/g0/e0", "actor/g0/e1"])
    # the reference serves the initial weights, which the first sync also gave the actor:
    # at step 0 the policy equals the reference, so the KL is zero; then training moves it
    assert abs(ms[0]["kl_ref"]) < 1e-4, ms[0]
    assert all(m["kl_model"] == "ref" and "kl_loss" in m for m in ms)
    assert any(abs(m["kl_ref"]) > 1e-4 for m in ms[1:]), [m["kl_ref"] for m in ms]
    # --kl-coef shapes each reward by the sample's summed KL
    assert all("kl_reward_penalty" in m for m in ms)
    assert any(abs(m["kl_reward_penalty"]) > 1e-5 for m in ms[1:])
    events = timeline(tmp_path)
    ref = states_of(events, "ref/g0/e0")
    dead = ref.index("DEAD")
    assert ref[dead:dead + 5] == ["DEAD", "RELAUNCHING", "STALE", "UPDATING", "REGISTERED"], ref
    assert "RECOVERED" in ref
    # frozen: never part of a weight update (no version was pushed into it)
    assert not [e for e in events if e["engine"] == "ref/g0/e0" and e["state"] == "UPDATING"
                and "version" in e], "the frozen model was synced"
    assert ms[-1]["engines"]["ref/g0/e0"] == "REGISTERED"
    no_process_outlives(tmp_path)
