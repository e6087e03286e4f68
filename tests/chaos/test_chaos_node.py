"""Chaos `node` on the real job (`-m slow`): a whole node of engines lost mid-run.

Three simulated nodes (`ray.cluster_utils.Cluster`): the trainer and two engines on one,
two engines on another, two free GPUs on the third. At a seeded step the `node` fault
SIGKILLs the raylet of the node with engines only (every Ray process there dies, as when
a host goes down); Ray declares it dead within a few seconds. The job trains on with the
survivors, sees both engines die, places them again on the free node, brings them back at
the fleet's version, and every step returns each sample once with the log-probability
check passing. (tests/fleet/test_elastic.py loses a node of the fleet in CI.)
"""

from __future__ import annotations

import json

import pytest

from slime_like.config.parse import parse_args
from slime_like.train import train
from tests.chaos.test_chaos import check_samples_and_versions
from tests.simulated_nodes import simulated_nodes
from tests.topologies.job_checks import no_process_outlives

STEPS = 12


@pytest.mark.slow
def test_a_lost_node_s_engines_come_back_on_a_free_node(tmp_path):
    with simulated_nodes(("127.0.0.2", "127.0.0.3", "127.0.0.4"), cpus=3, gpus=3,
                         node_death_s=4):
        args = parse_args(["--config", "configs/chaos.yaml", "--output-dir", str(tmp_path),
                           "--chaos-seed", "3", "--chaos-faults", "node", "kill_rollout",
                           "--num-rollout", str(STEPS), "--num-gpus-per-node", "3"])
        assert train(args) == 0
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    chaos = json.loads((tmp_path / "chaos.json").read_text())
    check_samples_and_versions(tmp_path, metrics, STEPS)
    node = next(f for f in chaos["faults"] if f["kind"] == "node")
    assert node["target"].startswith("node/") and len(node["lost"]) >= 1, node
    assert sorted(r["engine"] for r in node["effect"]) == sorted(node["lost"]), node
    events = [json.loads(x) for x in (tmp_path / "engine_timeline.jsonl").read_text()
              .splitlines()]
    lost_ip = node["target"].split("/", 1)[1]
    assert [e for e in events if e["state"] == "NODE_LOST"][0]["engine"] == node["target"]
    for engine in node["lost"]:
        back = [e for e in events if e["engine"] == engine and e["state"] == "STALE"][-1]
        assert lost_ip not in back["url"], back  # placed again on the free node
    assert chaos["violations"] == []
    no_process_outlives(tmp_path, grace_s=5)
