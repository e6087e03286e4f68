"""The parts of elastic membership without Ray: where an added engine goes (free bundles
of the job's placement group, consecutive GPUs of one node), and a drain's wait and move."""

from __future__ import annotations

import pytest

from slime_like.cluster.capacity import Capacity
from slime_like.cluster.placement import JobPlacement
from slime_like.config.layout import Bundle, added_engine, placement_group_layout, plan_job
from slime_like.config.sglang_config import parse_sglang_config
from slime_like.config.topology import TopologyInputs, resolve_sglang_config
from slime_like.errors import ConfigError
from slime_like.fleet import draining
from slime_like.fleet.draining import drain_requests


def _placement(num_gpus_per_engine: int, engines: int, actor_gpus: int = 2) -> JobPlacement:
    yaml = {"sglang": [{"name": "policy", "server_groups": [
        {"worker_type": "regular", "num_gpus": engines * num_gpus_per_engine,
         "num_gpus_per_engine": num_gpus_per_engine}]}]}
    topo = resolve_sglang_config(parse_sglang_config(yaml),
                                 TopologyInputs(hf_checkpoint="base", num_gpus_per_node=8))
    layout = placement_group_layout(actor_gpus=actor_gpus, rollout_gpus=topo.num_gpus)
    bundles = [Bundle(i, "10.0.0.1", i) for i in range(layout.num_bundles)]
    return JobPlacement(None, plan_job(topo, bundles, layout))


def test_an_added_engine_takes_the_bundles_a_stopped_engine_freed_never_a_trainers():
    placement = _placement(2, engines=2)  # trainer GPUs 0-1, engines on 2-3 and 4-5
    capacity = Capacity(placement)
    assert capacity.free() == []
    template = placement.plan.engines[0]
    capacity.release(placement.plan.engines[1].engine_id)
    placed = capacity.take(template, engine_index=2, timeout_s=0.1)
    assert (placed.engine_id, placed.base_gpu_id, placed.bundle_indices) == \
        ("policy/g0/e2", 4, (4, 5))
    assert (placed.placement_group, placed.shares_trainer_gpus, placed.node_rank) == (0, False, 0)
    assert capacity.free() == []
    capacity.release("policy/g0/e2")
    capacity.release(template.engine_id)
    assert sorted(b for _, b in capacity.free()) == [2, 3, 4, 5]  # never a trainer's 0-1


def test_an_added_engine_needs_consecutive_gpus_of_one_node():
    template = _placement(2, engines=1).plan.engines[0]
    with pytest.raises(ConfigError, match="2 consecutive GPUs of one node"):
        added_engine(template, [Bundle(7, "10.0.0.1", 1), Bundle(8, "10.0.0.2", 2)], 3, 1)
    with pytest.raises(ConfigError, match="2 consecutive GPUs"):
        added_engine(template, [Bundle(7, "10.0.0.1", 1), Bundle(8, "10.0.0.1", 3)], 3, 1)
    placed = added_engine(template, [Bundle(7, "10.0.0.9", 4), Bundle(8, "10.0.0.9", 5)], 3, 1)
    assert (placed.node_ip, placed.base_gpu_id, placed.placement_group) == ("10.0.0.9", 4, 1)


class FakeEngine:
    """An engine's session as a drain sees it: its load over time, and the abort."""

    url = "http://127.0.0.1:1"

    def __init__(self, loads: list[int | None], after_abort: int = 0):
        self.loads, self.after_abort, self.aborted = list(loads), after_abort, False

    def in_flight(self, timeout=None):
        if self.aborted:
            return self.after_abort
        return self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]

    def abort_request(self, rid="", abort_all=False, timeout=None):
        assert abort_all
        self.aborted = True


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(draining, "POLL_S", 0.01)


def test_a_drain_whose_requests_end_in_time_moves_none():
    engine = FakeEngine([3, 2, 0, 0])
    d = drain_requests("m/g0/e0", engine, deadline_s=5.0)
    assert (d.running, d.moved, d.answered, engine.aborted) == (3, 0, True, False)


def test_a_drain_past_its_deadline_moves_what_still_runs():
    engine = FakeEngine([4, 4, 4])
    d = drain_requests("m/g0/e0", engine, deadline_s=0.05)
    assert (d.running, d.moved, d.answered, engine.aborted) == (4, 4, True, True)


def test_a_drain_of_an_engine_that_stopped_answering_leaves_its_requests_to_their_clients():
    engine = FakeEngine([2, None])
    d = drain_requests("m/g0/e0", engine, deadline_s=5.0)
    assert (d.moved, d.answered, engine.aborted) == (0, False, False)
