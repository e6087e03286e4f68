"""Chaos runs: real faults at seeded moments of the real job, and the invariants checked."""

from slime_like.chaos.faults import (
    kill_engine,
    kill_node,
    kill_router,
    loseable_nodes,
    revert_weights,
    stop_engine,
)
from slime_like.chaos.invariants import InvariantSampler
from slime_like.chaos.monkey import FAULTS, ChaosMonkey, Fault, plan_faults, simulated_crash
from slime_like.chaos.partition import PARTITION, Partitioner, partitioner_for

__all__ = ["FAULTS", "PARTITION", "ChaosMonkey", "Fault", "InvariantSampler", "Partitioner",
           "kill_engine", "kill_node", "kill_router", "loseable_nodes", "partitioner_for",
           "plan_faults", "revert_weights", "simulated_crash", "stop_engine"]
