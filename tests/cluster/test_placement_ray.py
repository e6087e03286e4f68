"""Placement on a real (simulated) multi-node Ray cluster: probes, sorting, actor options.

One `ray.cluster_utils.Cluster` per module: a head without GPUs and two worker nodes with
distinct IPs (127.0.0.2, 127.0.0.3) and 4 declared GPUs each. Every test removes its
placement group, so the next one starts from an empty cluster.
"""

from __future__ import annotations

import pathlib

import pytest
import ray
from ray.util.placement_group import placement_group_table

from slime_like.cluster.placement import JobPlacement, place, place_job
from slime_like.config import parse_args
from slime_like.config.layout import placement_group_layout
from slime_like.config.slices import placement_settings
from slime_like.errors import PlacementError
from tests.simulated_nodes import simulated_nodes

NODES = ("127.0.0.2", "127.0.0.3")
GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def cluster():
    with simulated_nodes(NODES, cpus=GPUS_PER_NODE, gpus=GPUS_PER_NODE) as c:
        yield c


@ray.remote
class _Where:
    def where(self) -> tuple[str, list]:
        return ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()]


def _node_of_bundle(placement: JobPlacement) -> dict[int, str]:
    """Ray's own record of which node holds each bundle (the ground truth)."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    table = placement_group_table(placement.pg)["bundles_to_node_id"]
    return {int(i): ips[node] for i, node in table.items()}


def _seen_by_actors(options: list[dict]) -> list[tuple[str, list]]:
    actors = [_Where.options(**o).remote() for o in options]
    try:
        return ray.get([a.where.remote() for a in actors], timeout=120)
    finally:
        for a in actors:
            ray.kill(a)


def _job(tmp_path, groups_yaml: str, *flags: str):
    cfg = tmp_path / "groups.yaml"
    cfg.write_text(groups_yaml)
    return parse_args(["--hf-checkpoint", "base", "--num-gpus-per-node", str(GPUS_PER_NODE),
                       "--sglang-config", str(cfg), *flags])


def test_engines_land_on_the_node_and_gpus_placement_says(cluster, tmp_path):
    # Trainer 2 GPUs, then TP2 (starts mid-node), TP1, a placeholder, and TP2 on node 2.
    args = _job(tmp_path, """
sglang:
  - name: actor
    server_groups:
      - {worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}
      - {worker_type: regular, num_gpus: 1, num_gpus_per_engine: 1}
      - {worker_type: placeholder, num_gpus: 1}
      - {worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}
""", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "6")
    with place_job(placement_settings(args), timeout_s=60) as placement:
        plan = placement.plan
        assert [(b.node_ip, b.gpu_id) for b in plan.bundles] == [
            (ip, g) for ip in NODES for g in range(GPUS_PER_NODE)]
        truth = _node_of_bundle(placement)
        assert all(truth[b.index] == b.node_ip for b in plan.bundles)
        assert [(e.engine_id, e.node_ip, e.base_gpu_id) for e in plan.engines] == [
            ("actor/g0/e0", NODES[0], 2), ("actor/g1/e1", NODES[1], 0),
            ("actor/g3/e2", NODES[1], 2)]
        seen = _seen_by_actors([placement.engine_options(e) for e in plan.engines])
        assert seen == [(e.node_ip, [e.base_gpu_id]) for e in plan.engines]
        trainer_seen = _seen_by_actors([placement.trainer_options(r) for r in range(2)])
        assert trainer_seen == [(NODES[0], [0]), (NODES[0], [1])]
        pg_id = placement.pg.id
    assert placement.pg is None
    assert ray.util.placement_group_table()[pg_id.hex()]["state"] == "REMOVED"


def test_engine_larger_than_a_node_gets_one_actor_per_node(cluster, tmp_path):
    # 8-GPU engine on 4-GPU nodes (the 16-on-8 case at half scale), rollout only.
    args = _job(tmp_path, """
sglang:
  - name: big
    server_groups:
      - {worker_type: regular, num_gpus: 8, num_gpus_per_engine: 8}
""", "--debug-rollout-only")
    with place_job(placement_settings(args), timeout_s=60) as placement:
        engines = placement.plan.engines
        assert [(e.engine_index, e.node_rank, e.nnodes, e.node_ip, e.gpus_on_node)
                for e in engines] == [(0, 0, 2, NODES[0], 4), (0, 1, 2, NODES[1], 4)]
        assert {e.dist_init_host for e in engines} == {NODES[0]}
        seen = _seen_by_actors([placement.engine_options(e) for e in engines])
        assert seen == [(NODES[0], [0]), (NODES[1], [0])]


def test_colocated_trainer_rank_and_engine_share_one_bundle(cluster):
    args = parse_args(["--hf-checkpoint", "base", "--num-gpus-per-node", str(GPUS_PER_NODE),
                       "--actor-num-gpus-per-node", "2", "--colocate"])
    with place_job(placement_settings(args), timeout_s=60) as placement:
        engine = placement.plan.engines[1]
        assert engine.shares_trainer_gpus and engine.slot == 1
        seen = _seen_by_actors([placement.trainer_options(1), placement.engine_options(engine)])
        assert seen[0] == seen[1] == (engine.node_ip, [engine.base_gpu_id])


def test_too_large_a_placement_group_fails_in_time_and_is_removed(cluster):
    layout = placement_group_layout(actor_gpus=4, rollout_gpus=5)
    before = {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    with pytest.raises(PlacementError) as err:
        place(parse_args(["--hf-checkpoint", "b", "--rollout-num-gpus", "5"]).topology, layout,
              timeout_s=2)
    assert "placement group of 9 {'GPU': 1, 'CPU': 1} bundles not ready after 2s" in str(err.value)
    assert "the cluster has 8 GPUs" in str(err.value)
    after = {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    assert after == before


def test_quickstart_places_one_trainer_and_two_engines_on_declared_gpus(cluster):
    # The CPU job: GPUs are only declared to Ray, and the same placement code runs.
    config = pathlib.Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    with place_job(placement_settings(parse_args(["--config", str(config)])), timeout_s=60) as placement:
        plan = placement.plan
        assert len({b.node_ip for b in plan.bundles}) == 1  # PACK: one node holds all three
        node = plan.bundles[0].node_ip
        assert [(t.node_ip, t.gpu_id) for t in plan.trainer] == [(node, 0)]
        assert [(e.node_ip, e.base_gpu_id) for e in plan.engines] == [(node, 1), (node, 2)]
