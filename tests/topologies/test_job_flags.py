"""Flags of the job that change what it does, shown on one short run of the quickstart.

--update-weights-interval 2: syncs every second step; in between the trainer has moved on,
and the log-probability check still compares at the version the samples were made at (the
trainer keeps a copy of the served weights). --sglang-router-port fixes the router's port;
--sglang-router-request-timeout-secs reaches the router's command line; samples are as long
as --rollout-max-response-len and the check holds at --rollout-temperature 0.7.
"""

from __future__ import annotations

from slime_like.cluster.ports import free_port
from tests.topologies.job_checks import check_run, no_process_outlives, run_job, timeline

STEPS = 4


def test_interval_router_port_and_timeout(tmp_path, fresh_ray):
    port = free_port()
    run_job(tmp_path, "configs/quickstart.yaml", "--num-rollout", str(STEPS),
            "--simulate-engine-crash-at", "99", "--update-weights-interval", "2",
            "--sglang-router-port", str(port), "--sglang-router-request-timeout-secs", "77",
            "--rollout-temperature", "0.7", "--rollout-max-response-len", "5")
    ms = check_run(tmp_path, STEPS, ["default/g0/e0", "default/g0/e1"])
    # engines report logprobs at the rollout temperature; the check scales the same way
    assert all(m["response_len_mean"] == 5 for m in ms)
    assert [m["weight_version"] for m in ms] == [1, 2, 2, 3]
    assert [bool(m.get("sync_s")) for m in ms] == [False, True, False, True]
    # steps 0 and 2 trained past the served version before the next check: the check ran
    # against the copy of the served weights and held (check_run asserted < 1e-4)
    router = next(e for e in timeline(tmp_path) if e["engine"] == "router/default")
    assert router["url"].endswith(f":{port}")
    argv = (tmp_path / "logs" / "router-default.log").read_text().splitlines()[0]
    assert "--request-timeout-secs 77" in argv
    no_process_outlives(tmp_path)
