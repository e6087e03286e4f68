"""configs/multinode_cpu.yaml end to end on a simulated Ray cluster on one machine: a head
without GPUs and nodes on 127.0.0.2, 127.0.0.3 and 127.0.0.4 with one declared GPU each.
The trainer lands on the first node (bundles sort by IP) and one TP2 reference engine spans
the other two, one engine actor and one
server process per node. The server on node rank 1 is killed mid-run: the fleet sees it
(its actor's parked wait_exit returns), relaunches the whole engine on both nodes and
resyncs it before it serves again."""

from __future__ import annotations

import pytest

from tests.simulated_nodes import simulated_nodes
from tests.topologies.job_checks import check_run, no_process_outlives, run_job, states_of, timeline

STEPS = 4
ENGINE = "default/g0/e0"


@pytest.fixture
def three_nodes():
    with simulated_nodes(("127.0.0.2", "127.0.0.3", "127.0.0.4"), cpus=2, gpus=1) as c:
        yield c


def test_engine_spanning_two_nodes_recovers_from_a_death_on_node_1(tmp_path, three_nodes):
    run_job(tmp_path, "configs/multinode_cpu.yaml", "--num-rollout", str(STEPS),
            "--simulate-engine-crash-at", "1", "--simulate-engine-crash-node-rank", "1")
    check_run(tmp_path, STEPS, [ENGINE])
    events = timeline(tmp_path)
    states = states_of(events, ENGINE)
    dead = states.index("DEAD")
    assert states[dead:dead + 5] == ["DEAD", "RELAUNCHING", "STALE", "UPDATING", "REGISTERED"]
    assert "RECOVERED" in states
    # each node rank's server ran on its own node, and both were started twice
    logs = tmp_path / "logs"
    for rank, ip in ((0, "127.0.0.3"), (1, "127.0.0.4")):
        text = (logs / f"default-g0-e0-node{rank}.log").read_text(errors="replace")
        starts = [line for line in text.splitlines() if line.startswith("[slime_like] starting")]
        assert len(starts) == 2, (rank, starts)
        assert all(f"--host {ip}" in s and f"--node-rank {rank}" in s for s in starts)
    no_process_outlives(tmp_path)
