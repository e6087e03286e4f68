"""The asynchronous schedules of the real job (Ray, sglang-router, reference engines, gloo).

For `fully-async` in every pause mode (retract with admission dispatch: requests wait in
the rollout client for a free engine slot) and for `one-step`, each run must show what users of
asynchronous RL rely on: weight updates landed while requests were in flight, samples whose
tokens span versions were kept and checked token by token at their own versions, the
staleness bound held, every sample came back exactly once, and the engines end at the
final version. `--max-weight-staleness 0` reproduces the sync schedule's reward curve.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from tests.topologies.job_checks import check_run, metrics, run_job

CONFIG = "configs/async_cpu.yaml"
ENGINES = ["default/g0/e0", "default/g0/e1"]
BATCH, N = 4, 4  # smaller batches than async_cpu.yaml's (the benchmark's), for CI's time
# Each engine step lasts at least 100 ms, waited off the CPU as on a GPU: a batch's
# generation (24 steps) then outlasts the trainer's step even on a loaded 2-core machine,
# where engines and trainer would otherwise share the cores and either could finish first.
SMALL = ("--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N),
         "--rollout-max-response-len", "24", "--reference-min-step-ms", "100")
FILTER = "slime_like.rollout.filters.check_reward_nonzero_std"


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray cluster for the module's jobs (each job starts its own fleet)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def check_async_run(run_dir: Path, steps: int, bound: int) -> list[dict]:
    """The guarantees every asynchronous run keeps; its metrics."""
    ms = check_run(run_dir, steps, ENGINES)  # each step checked < 1e-4; engines at the end
    for m in ms:
        assert m["samples_returned"] == BATCH * N, m
        ages = [int(age) for age in m["staleness"]]
        assert max(ages) <= bound, (m["step"], m["staleness"])
        assert sum(m["staleness"].values()) == BATCH * N
    return ms


def check_exactly_once(run_dir: Path, ms: list[dict], steps: int) -> dict:
    """Every group admitted was trained on, dropped as stale or left over: once each."""
    summary = json.loads((run_dir / "async.json").read_text())
    groups = summary["groups"]
    assert summary["balanced"], groups
    assert groups["taken"] == steps * BATCH and groups["failed"] == 0, groups
    seqs = [seq for m in ms for seq in m["group_seqs"]]
    assert len(seqs) == len(set(seqs)) == steps * BATCH, seqs
    assert sum(m["samples_dropped_stale"] for m in ms) == groups["dropped_stale"] * N
    return groups


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort_partial"])
def test_fully_async_updates_weights_while_requests_run(tmp_path, shared_ray, mode):
    flags = {# the client binds each request to a free engine slot (admission dispatch)
             "retract": ["--pause-generation-mode", "retract", "--rollout-dispatch",
                         "admission"],
             "in_place": ["--pause-generation-mode", "in_place",
                          "--sglang-disable-radix-cache"],
             # with the off-policy correction and a dynamic-sampling filter as well
             "abort_partial": ["--pause-generation-mode", "abort", "--partial-rollout",
                               "--mask-offpolicy-in-partial-rollout",
                               "--use-rollout-logprobs", "--use-tis",
                               "--dynamic-sampling-filter-path", FILTER]}[mode]
    steps = 5
    run_job(tmp_path, CONFIG, *SMALL, "--num-rollout", str(steps), "--max-weight-staleness", "1",
            *flags)
    ms = check_async_run(tmp_path, steps, bound=1)
    check_exactly_once(tmp_path, ms, steps)
    # weight updates happened while the producer had requests running
    assert sum(m["groups_in_flight_at_sync"] > 0 for m in ms) >= 2, \
        [m["groups_in_flight_at_sync"] for m in ms]
    # samples whose tokens span two versions were trained on, each token checked at its own
    mixed = sum(m["logprob_checked_mixed_samples"] for m in ms)
    assert mixed == sum(m["samples_mixed_version"] for m in ms)
    if mode == "abort_partial":  # continued samples always span the update
        assert mixed > 0 and any(len(m["sample_weight_versions"]) > 1 for m in ms)
    if mode == "abort_partial":
        # the update aborted requests; each came back with its tokens and was continued
        assert sum(m["requests_aborted"] for m in ms) > 0
        assert sum(m["samples_partial"] for m in ms) > 0
        assert sum(m["partial_resubmits"] for m in ms) > 0
        # the loss weighed the tokens by the engines' logprobs; samples a version behind
        # are off-policy, so the trainer's logprobs differ from the engines' there
        assert all(0 < m["tis_mean"] <= 2.0 and m["ratio_mean"] > 0 for m in ms)
        assert max(m["train_rollout_logprob_abs_diff"] for m in ms) > 0


def test_one_step_overlaps_rollout_with_training(tmp_path, shared_ray):
    steps = 4
    run_job(tmp_path, CONFIG, *SMALL, "--async-mode", "one-step", "--num-rollout", str(steps),
            "--dynamic-sampling-filter-path", FILTER, "--over-sampling-batch-size", "6")
    ms = check_async_run(tmp_path, steps, bound=1)
    # dynamic sampling drew 6 prompts a round and kept 4 groups whose rewards differ
    assert all(m["dynamic_sampling_prompts_drawn"] >= 6 for m in ms)
    assert all(m["dynamic_sampling_kept"] >= BATCH for m in ms)
    # from the second step on every sample is exactly one version behind the trained one,
    # and generation is drained before each update: no sample spans versions
    assert [sorted(m["staleness"]) for m in ms[1:]] == [["1"]] * (steps - 1)
    assert all(m["logprob_checked_mixed_samples"] == 0 for m in ms)
    assert [m["sample_weight_versions"] for m in ms] == [[1]] + [[v] for v in range(1, steps)]


def test_staleness_zero_reproduces_the_sync_schedule(tmp_path, shared_ray):
    steps = 3
    sync = metrics_of(tmp_path / "sync", steps, "--async-mode", "sync")
    zero = metrics_of(tmp_path / "zero", steps, "--async-mode", "fully-async",
                      "--max-weight-staleness", "0")
    assert [m["reward_mean"] for m in zero] == [m["reward_mean"] for m in sync]
    assert [m["sample_weight_versions"] for m in zero] == \
        [m["sample_weight_versions"] for m in sync]
    assert all(list(m["staleness"]) == ["0"] for m in zero)


def metrics_of(run_dir: Path, steps: int, *flags: str) -> list[dict]:
    run_job(run_dir, CONFIG, *SMALL, "--num-rollout", str(steps), *flags)
    return metrics(run_dir)
