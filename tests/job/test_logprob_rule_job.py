"""The log-probability check on the real job, right both ways (Ray, sglang-router,
reference engines, gloo).

- An engine one version behind while claiming the newer one (its weights put back to the
  launch checkpoint through its own `/update_weights_from_disk` right after the first
  sync, its label kept) fails the step by name, in every schedule, at the quickstart's
  learning rate and at 1e-6, where the two versions differ by about as little as the old
  single-token tolerance.
- Long healthy runs end whole: no false failure, every step's noise reported, the probe
  confirming each engine's version (300 steps with a router and an engine killed:
  tests/job/test_train_job.py; 1,000 steps at three seeds here, a long form).
"""

from __future__ import annotations

import pytest
import ray

from slime_like.job.checks import LogprobMismatch
from tests.topologies.job_checks import check_run, no_process_outlives, run_job

CONFIG = "configs/quickstart.yaml"
ENGINES = ["default/g0/e0", "default/g0/e1"]
STALE = (r"engine default/g0/e0 \(http://[^)]+\) claims weight version 2 but serves "
         r"version 1: on the probe's \d+ tokens")


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray cluster for the module's jobs (each job starts its own fleet)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


CASES = [("sync", "1e-6"),
         # the other schedules and the quickstart's learning rate: the long forms
         *[pytest.param(mode, lr, marks=pytest.mark.slow) for mode, lr in
           (("fully-async", "1e-6"), ("one-step", "1e-6"), ("sync", "0.002"),
            ("one-step", "0.002"), ("fully-async", "0.002"))]]


@pytest.mark.parametrize(("mode", "lr"), CASES)
def test_an_engine_one_version_behind_fails_the_step_naming_it(tmp_path, shared_ray, mode, lr):
    flags = ["--num-rollout", "4", "--lr", lr, "--simulate-stale-engine-at", "0",
             "--simulate-engine-crash-at", "99", "--rollout-batch-size", "4",
             "--async-mode", mode]
    with pytest.raises(LogprobMismatch, match=STALE):
        run_job(tmp_path, CONFIG, *flags)
    no_process_outlives(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7, 11, 13])
def test_a_thousand_steps_end_whole(tmp_path, shared_ray, seed):
    ms = run_job(tmp_path, CONFIG, "--num-rollout", "1000", "--seed", str(seed))
    check_run(tmp_path, 1000, ENGINES)
    assert max(m["logprob_sample_mean_diff_max"] for m in ms) < 1e-4
    assert all(m["logprob_probe_confirmed"] == m["logprob_probe_engines"] for m in ms[1:])
    assert ms[-1]["logprob_probe_confirmed"] == 2
