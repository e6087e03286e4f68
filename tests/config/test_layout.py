"""Placement as a pure function over sorted bundles: slime's layout table and our fixes."""

from __future__ import annotations

import pytest

from slime_like.config import parse_args
from slime_like.config.layout import (
    Bundle,
    placement_group_layout,
    plan_job,
    sort_bundles,
)
from slime_like.config.sglang_config import parse_sglang_config
from slime_like.config.topology import TopologyInputs, resolve_sglang_config
from slime_like.errors import ConfigError


@pytest.mark.parametrize(("kw", "expected"), [
    pytest.param({}, (48, 16), id="normal"),
    pytest.param({"debug_train_only": True}, (16, 0), id="train_only"),
    pytest.param({"debug_rollout_only": True}, (32, 0), id="rollout_only"),
    pytest.param({"colocate": True, "rollout_gpus": 8}, (16, 0), id="colocate_fewer_rollout"),
    pytest.param({"colocate": True, "rollout_gpus": 16}, (16, 0), id="colocate_equal"),
    pytest.param({"colocate": True, "rollout_gpus": 32}, (32, 0), id="colocate_more_rollout"),
    pytest.param({"rollout_gpus": 0}, (16, 16), id="zero_rollout_gpus"),
    pytest.param({"colocate": True, "rollout_gpus": 0}, (16, 0), id="colocate_zero_rollout"),
    pytest.param({"rollout_external": True}, (16, 16), id="external"),
    pytest.param({"rollout_external": True, "debug_rollout_only": True}, (0, 0),
                 id="external_rollout_only"),
])
def test_placement_group_size_and_rollout_offset(kw, expected):
    # slime's table, with 2 trainer nodes of 8 GPUs and 32 rollout GPUs unless changed.
    args = {"actor_gpus": 16, "rollout_gpus": 32, **kw}
    layout = placement_group_layout(**args)
    assert (layout.num_bundles, layout.rollout_offset) == expected


def _bundles(*nodes: tuple[str, int]) -> list[Bundle]:
    """Bundles of nodes given as (ip, gpus), indexed in the order given."""
    out, i = [], 0
    for ip, gpus in nodes:
        for g in range(gpus):
            out.append(Bundle(i, ip, g))
            i += 1
    return out


def _plan(yaml_data: dict, bundles: list[Bundle], *, actor_gpus: int, gpn: int = 8,
          colocate: bool = False, hf: str = "base"):
    inputs = TopologyInputs(hf_checkpoint=hf, num_gpus_per_node=gpn)
    topo = resolve_sglang_config(parse_sglang_config(yaml_data), inputs)
    layout = placement_group_layout(actor_gpus=actor_gpus, rollout_gpus=topo.num_gpus,
                                    colocate=colocate)
    return plan_job(topo, sort_bundles(bundles), layout)


def _rows(plan):
    return [(e.engine_id, e.node_rank, e.slot, e.node_ip, e.base_gpu_id, e.gpus_on_node)
            for e in plan.engines]


def test_bundles_sort_by_numeric_ip_then_gpu_id():
    shuffled = [Bundle(0, "10.0.0.10", 1), Bundle(1, "10.0.0.9", 0), Bundle(2, "10.0.0.10", 0),
                Bundle(3, "10.0.0.9", 1), Bundle(4, "fd00::1", 0)]
    assert [(b.node_ip, b.gpu_id) for b in sort_bundles(shuffled)] == [
        ("10.0.0.9", 0), ("10.0.0.9", 1), ("10.0.0.10", 0), ("10.0.0.10", 1), ("fd00::1", 0)]


def test_group_starting_mid_node_gets_that_nodes_ip():
    # slime PR #2373: trainer 4 GPUs + rollout 12 on two 8-GPU nodes; slime derives an engine's
    # node from its rank and sends the second node's engines to the first.
    bundles = _bundles(("10.0.0.2", 8), ("10.0.0.3", 8))
    plan = _plan({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 12, "num_gpus_per_engine": 4}]}]},
        bundles, actor_gpus=4)
    assert _rows(plan) == [
        ("m/g0/e0", 0, 4, "10.0.0.2", 4, 4),
        ("m/g0/e1", 0, 8, "10.0.0.3", 0, 4),
        ("m/g0/e2", 0, 12, "10.0.0.3", 4, 4)]
    assert [(t.rank, t.node_ip, t.gpu_id) for t in plan.trainer] == [
        (r, "10.0.0.2", r) for r in range(4)]


def test_sixteen_gpu_engine_on_eight_gpu_nodes_gets_two_actors():
    bundles = _bundles(("10.0.0.2", 8), ("10.0.0.3", 8), ("10.0.0.4", 8))
    plan = _plan({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 16, "num_gpus_per_engine": 16}]}]},
        bundles, actor_gpus=8)
    assert _rows(plan) == [("m/g0/e0", 0, 8, "10.0.0.3", 0, 8), ("m/g0/e0", 1, 16, "10.0.0.4", 0, 8)]
    assert {(e.nnodes, e.dist_init_host, e.num_gpus) for e in plan.engines} == {(2, "10.0.0.3", 16)}
    assert [e.serves_http for e in plan.engines] == [True, False]
    assert plan.engines[1].bundle_indices == tuple(range(16, 24))


def test_heterogeneous_groups_with_a_placeholder():
    # slime's sglang_config e2e layout: TP2 + TP1 + placeholder, 4 trainer + 4 rollout GPUs.
    bundles = _bundles(("10.0.0.2", 8))
    plan = _plan({"sglang": [{"name": "actor", "server_groups": [
        {"worker_type": "regular", "num_gpus": 2, "num_gpus_per_engine": 2},
        {"worker_type": "regular", "num_gpus": 1, "num_gpus_per_engine": 1},
        {"worker_type": "placeholder", "num_gpus": 1}]}]}, bundles, actor_gpus=4)
    assert _rows(plan) == [("actor/g0/e0", 0, 4, "10.0.0.2", 4, 2),
                           ("actor/g1/e1", 0, 6, "10.0.0.2", 6, 1)]
    assert plan.reserved_slots == (("sglang[0].server_groups[2]", 7, 1),)


def test_two_models_get_one_router_each_and_consecutive_slots():
    bundles = _bundles(("10.0.0.2", 4), ("10.0.0.3", 4))
    plan = _plan({"sglang": [
        {"name": "actor", "server_groups": [
            {"worker_type": "prefill", "num_gpus": 1}, {"worker_type": "decode", "num_gpus": 1}]},
        {"name": "ref", "model_path": "ref", "update_weights": False, "server_groups": [
            {"worker_type": "regular", "num_gpus": 4, "num_gpus_per_engine": 2,
             "overrides": {"mem_fraction_static": 0.5}}]}]},
        bundles, actor_gpus=2, gpn=4)
    assert [(r.model_name, r.pd_disaggregation, r.update_weights, r.num_engines)
            for r in plan.routers] == [("actor", True, True, 2), ("ref", False, False, 2)]
    assert _rows(plan) == [("actor/g0/e0", 0, 2, "10.0.0.2", 2, 1),
                           ("actor/g1/e1", 0, 3, "10.0.0.2", 3, 1),
                           ("ref/g0/e0", 0, 4, "10.0.0.3", 0, 2),
                           ("ref/g0/e1", 0, 6, "10.0.0.3", 2, 2)]
    assert dict(plan.engines_of("ref")[0].overrides) == {"mem_fraction_static": 0.5}
    assert plan.engines_of("ref")[0].model_path == "ref"


def test_colocated_engines_share_the_trainer_slots():
    bundles = _bundles(("10.0.0.2", 4))
    plan = _plan({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 4, "num_gpus_per_engine": 2}]}]},
        bundles, actor_gpus=2, gpn=4, colocate=True)
    assert [(e.slot, e.shares_trainer_gpus) for e in plan.engines] == [(0, True), (2, False)]
    assert [t.bundle_index for t in plan.trainer] == [0, 1]


def test_engine_gpus_follow_probed_bundles_not_bundle_indices():
    # Ray may hand out bundle indices in any node order; slots follow (IP, GPU).
    bundles = [Bundle(i, "10.0.0.3" if i < 2 else "10.0.0.2", i % 2) for i in range(4)]
    plan = _plan({"sglang": [{"name": "m", "server_groups": [
        {"worker_type": "regular", "num_gpus": 2}]}]}, bundles, actor_gpus=2, gpn=2)
    assert [(t.bundle_index, t.node_ip) for t in plan.trainer] == [(2, "10.0.0.2"),
                                                                   (3, "10.0.0.2")]
    assert [(e.bundle_index, e.node_ip, e.base_gpu_id) for e in plan.engines] == [
        (0, "10.0.0.3", 0), (1, "10.0.0.3", 1)]


def test_engine_on_a_smaller_real_node_is_caught_after_probing():
    # The nominal check assumed 8-GPU nodes; the cluster has a 6-GPU node.
    bundles = _bundles(("10.0.0.2", 6), ("10.0.0.3", 6))
    with pytest.raises(ConfigError) as err:
        _plan({"sglang": [{"name": "m", "server_groups": [
            {"worker_type": "regular", "num_gpus": 8, "num_gpus_per_engine": 4}]}]},
            bundles, actor_gpus=4)
    assert str(err.value) == (
        "sglang[0].server_groups[0]: engine 0 of this group would span nodes 10.0.0.2 and "
        "10.0.0.3 (slots 4..7); make num_gpus_per_engine divide the GPUs per node, or put a "
        "placeholder group before it to start it on a node boundary")


def test_external_jobs_place_no_engines():
    ext = parse_args(["--hf-checkpoint", "m", "--use-fault-tolerance",
                      "--actor-num-gpus-per-node", "2", "--rollout-external-engine-addrs", "h:1"])
    assert ext.nominal_plan.engines == () and len(ext.nominal_plan.trainer) == 2
    assert [r.model_name for r in ext.nominal_plan.routers] == ["default"]


def test_plan_and_topology_survive_pickling_for_ray_actors(tmp_path):
    import pickle

    cfg = tmp_path / "g.yaml"
    cfg.write_text("sglang:\n  - name: m\n    server_groups:\n      - worker_type: regular\n"
                   "        num_gpus: 2\n        overrides: {mem_fraction_static: 0.5}\n")
    args = parse_args(["--hf-checkpoint", "m", "--sglang-config", str(cfg),
                       "--actor-num-gpus-per-node", "2"])
    plan = pickle.loads(pickle.dumps(args.nominal_plan))
    assert plan == args.nominal_plan
    assert pickle.loads(pickle.dumps(args.topology)) == args.topology
    assert plan.engines[0].overrides == {"mem_fraction_static": 0.5}
    assert vars(pickle.loads(pickle.dumps(args))) == vars(args)  # args go to Ray actors whole
