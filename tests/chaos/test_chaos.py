"""Chaos run of the real job: every kind of fault, and what users rely on still holds.

Short form (CI): four engines, ten steps, seven faults — SIGKILL during a rollout and at
the pause, transfer, end and continue steps of a weight sync, a SIGSTOPped engine, a
SIGKILLed router. The fully-async form fires the same faults while weights are updated
with requests in flight. The long forms (`-m slow`) repeat them over several seeds.
"""

from __future__ import annotations

import json

import pytest
import ray

from slime_like.config.parse import parse_args
from slime_like.train import train
from tests.topologies.job_checks import no_process_outlives


@pytest.fixture(scope="module")
def fresh_ray():
    """One local Ray cluster for the module's runs (every run starts its own fleet, trainer
    and placement group, and stops them at its end)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def run_chaos(run_dir, seed: int, steps: int = 16, *flags: str) -> dict:
    args = parse_args(["--config", "configs/chaos.yaml", "--output-dir", str(run_dir),
                       "--chaos-seed", str(seed), "--num-rollout", str(steps), *flags])
    assert train(args) == 0  # every step completed (a violation raises)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    chaos = json.loads((run_dir / "chaos.json").read_text())
    return {"metrics": metrics, "chaos": chaos}


def check_samples_and_versions(run_dir, metrics: list[dict], steps: int) -> None:
    """Every step returned each sample once and passed the log-probability check, and every
    engine of the updatable model ends (before the shutdown) routed at the final version:
    the run waits for the last recoveries."""
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert m["samples_returned"] == m["samples_requested"], m
        assert m["logprob_sample_mean_diff_max"] < 1e-4, m
    final = metrics[-1]["weight_version"]
    events = [json.loads(x) for x in (run_dir / "engine_timeline.jsonl").read_text().splitlines()]
    versions = [e for e in events if e["engine"] == "fleet" and e["state"] == "VERSION"]
    assert int(versions[-1]["version"]) == final
    for engine in metrics[-1]["engines"]:
        mine = [e for e in events if e["engine"] == engine and e["state"] != "STOPPED"]
        last = [e for e in mine if e["state"] in ("REGISTERED", "UPDATING", "STALE")][-1]
        assert mine[-1]["state"] in ("REGISTERED", "RECOVERED"), (engine, mine[-3:])
        assert last["state"] == "REGISTERED" and int(last["version"]) == final, (engine, last)


def check(run_dir, out: dict, steps: int) -> None:
    metrics, chaos = out["metrics"], out["chaos"]
    check_samples_and_versions(run_dir, metrics, steps)
    # every fault fired, on an engine (or the router), and every death was recovered
    assert sorted(f["kind"] for f in chaos["faults"]) == sorted(
        ["kill_rollout", "kill_pause", "kill_transfer", "kill_end", "kill_continue",
         "stop_engine", "kill_router"])
    # each fault really happened: its target died (or the router restarted) after it fired
    assert all(f["fired_at"] and f["target"] and f["effect"] for f in chaos["faults"]), \
        chaos["faults"]
    assert chaos["recoveries"] and all("recovery_s" in r for r in chaos["recoveries"])
    assert chaos["router_restarts"], "the router was killed and must have been relaunched"
    # the outside sampler looked often enough to mean something, and saw nothing wrong
    assert chaos["samples"] > 50 and chaos["violations"] == []
    no_process_outlives(run_dir, grace_s=5)  # nothing of the run alive 5 s after it ended


def test_chaos_short_form(tmp_path, fresh_ray):
    out = run_chaos(tmp_path, seed=7, steps=10)  # the fewest steps that fit all seven faults
    check(tmp_path, out, 10)
    # and by the engines' own served logs: no request finished at a version older than the
    # fleet's at that moment, whatever the faults did
    assert out["chaos"]["stale_serves"] == [], out["chaos"]["stale_serves"][:5]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_chaos_long_form(tmp_path, fresh_ray, seed):
    out = run_chaos(tmp_path, seed=seed, steps=24)
    check(tmp_path, out, 24)


# Engine steps of at least 100 ms, waited off the CPU as on a GPU: a batch's generation then
# outlasts the trainer's step on a loaded machine, so updates land while requests run.
FULLY_ASYNC = ("--fully-async", "--pause-generation-mode", "abort", "--partial-rollout",
               "--reference-min-step-ms", "100")


def check_fully_async(run_dir, out: dict, steps: int) -> None:
    """Kills during in-flight updates lose and double nothing: every group admitted was
    trained on, dropped as stale or left over at the end, exactly once."""
    check(run_dir, out, steps)
    summary = json.loads((run_dir / "async.json").read_text())
    groups = summary["groups"]
    assert summary["balanced"] and groups["failed"] == 0, groups
    seqs = [seq for m in out["metrics"] for seq in m["group_seqs"]]
    assert len(seqs) == len(set(seqs)) == groups["taken"] == steps * 4, seqs
    # updates landed while requests ran, and aborted samples were continued from their tokens
    assert sum(m["groups_in_flight_at_sync"] > 0 for m in out["metrics"]) >= 2
    assert sum(m["samples_partial"] for m in out["metrics"]) > 0


def test_chaos_fully_async_short_form(tmp_path, fresh_ray):
    out = run_chaos(tmp_path, 7, 10, *FULLY_ASYNC)
    check_fully_async(tmp_path, out, 10)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_chaos_fully_async_long_form(tmp_path, fresh_ray, seed):
    out = run_chaos(tmp_path, seed, 24, *FULLY_ASYNC)
    check_fully_async(tmp_path, out, 24)
