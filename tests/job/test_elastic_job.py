"""The real job takes scale commands from its operator while it trains (`-m slow`).

The quickstart job (one trainer rank, two reference engines) runs on a local Ray cluster
with one GPU more than it places; mid-run `slime-like fleet scale RUN_DIR --engines 3`
adds an engine there, then `--engines 1` drains two while rollouts run. Every step
returns each requested sample once and passes the log-probability check; the added engine
serves only at the trainer's version; the drained ones stop; nothing is left running.
(tests/fleet/test_elastic.py is the short form, on the fleet itself.)
"""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest
import ray

from slime_like.config.parse import parse_args
from slime_like.job.scaling import request_scale
from slime_like.train import train

STEPS = 40


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.slow
def test_a_running_job_scales_its_fleet_on_its_operators_command(tmp_path):
    ray.init(address="local", num_cpus=6, num_gpus=4, include_dashboard=False)
    try:
        args = parse_args(["--config", "configs/quickstart.yaml", "--output-dir", str(tmp_path),
                           "--num-rollout", str(STEPS), "--simulate-engine-crash-at",
                           str(STEPS * 10), "--rollout-batch-size", "4",
                           "--n-samples-per-prompt", "2", "--reference-min-step-ms", "20"])
        result: dict = {}
        job = threading.Thread(target=lambda: result.update(rc=train(args)), daemon=True)
        job.start()
        deadline = time.monotonic() + 300
        while not (tmp_path / "scale" / "job.json").is_file():
            assert job.is_alive() and time.monotonic() < deadline, "the job never started"
            time.sleep(0.2)
        grown = request_scale(tmp_path, 3, wait_s=300)
        assert len(grown["added"]) == 1, grown
        shrunk = request_scale(tmp_path, 1, drain_deadline_s=0.2, wait_s=300)
        assert len(shrunk["drained"]) == 2, shrunk
        job.join(timeout=600)
        assert result.get("rc") == 0
    finally:
        ray.shutdown()

    steps = _lines(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert all(s["samples_returned"] == s["samples_requested"] == 8 for s in steps)
    assert all(s["logprob_sample_mean_diff_max"] < 1e-4 for s in steps)
    events = _lines(tmp_path / "engine_timeline.jsonl")
    added = grown["added"][0]
    mine = [e for e in events if e["engine"] == added]
    states = [e["state"] for e in mine]
    assert states[:5] == ["LAUNCHING", "LOADED", "STALE", "UPDATING", "REGISTERED"], states
    for d in shrunk["drained"]:
        left = [e["state"] for e in events if e["engine"] == d["engine"]]
        assert left[-3:] == ["DRAINING", "DRAINED", "STOPPED"], left
    assert set(steps[-1]["engines"]) == {"default/g0/e0"}
    leftovers = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                 if str(tmp_path) in " ".join(p.info["cmdline"] or [])
                 and "pytest" not in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, leftovers
