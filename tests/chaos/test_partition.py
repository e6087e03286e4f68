"""The chaos fault `partition` where it cannot run, and how it reaches a host's link.

The fault itself, on hosts with network stacks of their own, is run by
`tests/hosts/test_hosts_cluster.py` (a chaos run across three hosts, `-m slow`).
"""

from __future__ import annotations

import json
import sys

import pytest

from slime_like.chaos.monkey import plan_faults
from slime_like.chaos.partition import Partitioner, check_partitionable, partitionable_nodes
from slime_like.config.parse import parse_args
from slime_like.errors import ConfigError

# One GPU per node: the trainer on node0, an engine on each of node1 and node2.
HOSTS = ["--engine", "reference", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
         "--num-gpus-per-node", "1"]
CHAOS = ["--chaos-seed", "3", "--chaos-faults", "partition"]
SWITCH = ["--chaos-partition-command", "switch-cli cut {node_ip} {seconds}"]


@pytest.mark.parametrize("flags, why", [
    (CHAOS, "needs a command that cuts the host {node_ip}'s cluster link"),
    ([*CHAOS, "--chaos-partition-command", "ip link set eth1 down"], "missing ['node_ip', "
                                                                      "'seconds']"),
    ([*CHAOS, "--chaos-partition-command", "cut {node_ip} {seconds} {port}"], "unknown ['port']"),
    ([*CHAOS, "--chaos-partition-command", "cut '{node_ip} {seconds}"], "is not a command"),
    (SWITCH, "no chaos run has the fault `partition`"),
])
def test_a_partition_without_a_usable_command_is_refused_naming_the_flag(flags, why):
    with pytest.raises(ConfigError) as err:
        parse_args([*HOSTS, *flags])
    assert err.value.path == "--chaos-partition-command" and why in str(err.value), err.value


def test_partition_is_not_among_the_default_faults():
    assert "partition" not in parse_args([*HOSTS, "--chaos-seed", "3"]).chaos_faults


def test_only_engine_hosts_without_the_trainer_or_the_driver_can_be_cut():
    plan = parse_args([*HOSTS, *CHAOS, *SWITCH]).nominal_plan
    assert partitionable_nodes(plan, driver_ip="node0") == {"node1": ["default/g0/e0"],
                                                           "node2": ["default/g0/e1"]}
    # the driver (and its routers) on an engine's host: that host stays
    assert partitionable_nodes(plan, driver_ip="node1") == {"node2": ["default/g0/e1"]}


def test_one_machine_has_no_host_to_cut_and_says_where_everything_is():
    plan = parse_args([*HOSTS[:-1], "4", *CHAOS, *SWITCH]).nominal_plan  # one 4-GPU node
    with pytest.raises(ConfigError) as err:
        check_partitionable(plan, driver_ip="node0")
    text = str(err.value)
    assert err.value.path == "--chaos-faults partition", text
    for part in ("no engine host can be partitioned", "default/g0/e0@node0",
                 "the trainer on ['node0']", "the driver on node0",
                 "leave `partition` out of --chaos-faults"):
        assert part in text, text


def test_a_partition_runs_the_command_for_the_host_and_a_failed_one_is_an_error(tmp_path):
    said = tmp_path / "said.json"
    record = f"import json,sys; json.dump(sys.argv[1:], open({str(said)!r}, 'w'))"
    p = Partitioner(f"{sys.executable} -c \"{record}\" {{node_ip}} {{seconds}}", 2.5,
                    {"198.18.7.12": ["default/g0/e1"], "198.18.7.11": ["default/g0/e0"]})
    assert p.pick(1, live=["default/g0/e0", "default/g0/e1"]) == ("198.18.7.12", "default/g0/e1")
    assert p.pick(1, live=["default/g0/e0"]) == ("198.18.7.11", "default/g0/e0")
    cut = p.cut("198.18.7.12", "default/g0/e1")
    assert json.loads(said.read_text()) == ["198.18.7.12", "2.5"]
    assert cut["returncode"] == 0 and cut["heals_at"] == cut["cut_at"] + 2.5
    failing = Partitioner(f"{sys.executable} -c \"import sys; sys.exit('no such port')\" "
                          "{node_ip} {seconds}", 2.5, p.nodes)
    with pytest.raises(RuntimeError, match="exited 1: no such port"):
        failing.cut("198.18.7.11", "default/g0/e0")


def test_a_partition_is_planned_beside_the_other_faults():
    faults = plan_faults(3, ["partition", "kill_rollout"], 10, 2)
    assert sorted(f.kind for f in faults) == ["kill_rollout", "partition"]
