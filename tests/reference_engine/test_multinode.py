"""Multi-node engines on one machine: node 0 on 127.0.0.1, node 1 on 127.0.0.2.

A TP=2 engine spread over two nodes (`--nnodes 2`): node 0's process serves HTTP and runs
TP rank 0, node 1's process runs TP rank 1 and joins through `--dist-init-addr`. What the
orchestrator relies on: it generates like a TP=1 engine, a distributed weight update reaches
the rank on node 1, and losing node 1 takes node 0 down within a bounded time (so the whole
engine is recovered), and the other way round.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from slime_like.cluster.ports import free_port
from slime_like.models.loading import init_dummy_weights, load_pretrained
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.weights import WeightSync
from tests.reference_engine.conftest import (
    RunningEngine,
    start_engine,
    stop_engine,
    wait_until_healthy,
)
from tests.weights.weight_sync_helpers import model_checksum

TOK = ByteTokenizer()
NODE_HOSTS = ("127.0.0.1", "127.0.0.2")
NODE_TIMEOUT_S = 4.0  # heartbeat silence after which node 0 gives up on node 1


@dataclass
class TwoNodeEngine:
    node0: RunningEngine
    node1: subprocess.Popen
    node1_log: Path

    def stop(self) -> None:
        stop_engine(self.node0)
        _stop(self.node1)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def start_two_nodes(model_dir: Path, log_dir: Path, attempts: int = 3) -> TwoNodeEngine:
    """Node 0 (HTTP) and node 1 of one TP=2 engine; returns once node 0 answers /health.

    A free port can be taken by another process before node 0 binds it (tests run in
    parallel): then both nodes start again on new ports, as the project's launcher does.
    """
    for attempt in range(attempts):
        try:
            return _start_two_nodes(model_dir, log_dir)
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start_two_nodes(model_dir: Path, log_dir: Path) -> TwoNodeEngine:
    dist_init = f"{NODE_HOSTS[0]}:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", dist_init, "--weight-version", "v0"]
    env = {"SLIME_LIKE_REFERENCE_NODE_TIMEOUT": str(NODE_TIMEOUT_S),
           "no_proxy": ",".join(NODE_HOSTS), "NO_PROXY": ",".join(NODE_HOSTS)}
    node0 = start_engine(model_dir, log_dir, *common, "--node-rank", "0", env=env, wait_healthy=False)
    port1 = free_port()
    log1 = log_dir / f"node1-{port1}.log"
    with open(log1, "wb") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "slime_like.reference_engine", "--model-path", str(model_dir),
             "--host", NODE_HOSTS[1], "--port", str(port1), *common, "--node-rank", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    try:
        wait_until_healthy(node0, timeout=120)
    except BaseException:
        _stop(node1)
        raise
    return TwoNodeEngine(node0, node1, log1)


@pytest.fixture(scope="module")
def two_nodes(tiny_model_dir, engine_log_dir) -> Iterator[TwoNodeEngine]:
    pair = start_two_nodes(tiny_model_dir, engine_log_dir)
    yield pair
    pair.stop()


@pytest.fixture(scope="module")
def tp1(tiny_model_dir, engine_log_dir) -> Iterator[RunningEngine]:
    e = start_engine(tiny_model_dir, engine_log_dir, "--weight-version", "v0")
    yield e
    stop_engine(e)


def _generate(engine: RunningEngine, seeded: bool) -> dict:
    sp = {"max_new_tokens": 10, "ignore_eos": True}
    sp.update({"temperature": 0.8, "sampling_seed": 11} if seeded else {"temperature": 0})
    r = engine.generate({"input_ids": TOK.encode("two nodes, one engine"), "sampling_params": sp,
                         "return_logprob": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_two_node_engine_serves_from_node_0_like_a_tp1_engine(two_nodes, tp1):
    info = two_nodes.node0.get("/server_info").json()
    assert (info["tp_size"], info["nnodes"], info["node_rank"]) == (2, 2, 0)
    for seeded in (False, True):
        got, want = _generate(two_nodes.node0, seeded), _generate(tp1, seeded)
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
    assert two_nodes.node1.poll() is None


def test_a_distributed_weight_update_reaches_the_rank_on_node_1(two_nodes, tp1, tiny_model_dir):
    model = load_pretrained(tiny_model_dir)
    init_dummy_weights(model, seed=777)
    # The engine takes ranks 1 (node 0) and 2 (node 1) of the group, the TP=1 engine rank 3.
    sync = WeightSync([(two_nodes.node0.url, 2), (tp1.url, 1)], update_weight_buffer_size=64 << 10,
                      http_timeout_s=60, group_timeout_s=60)
    try:
        sync.update(model, weight_version="v1")
    finally:
        sync.close()
    body = two_nodes.node0.post("/weights_checker", {"action": "checksum"}).json()
    assert body["success"], body
    expected = model_checksum(model)
    assert [r["parallelism_info"][0]["tp_rank"] for r in body["ranks"]] == [0, 1]
    assert [r["per_gpu_checksum"] for r in body["ranks"]] == [expected, expected]
    assert two_nodes.node0.get("/model_info").json()["weight_version"] == "v1"
    got, want = _generate(two_nodes.node0, True), _generate(tp1, True)
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_losing_node_1_takes_node_0_down_within_bounded_time(tiny_model_dir, engine_log_dir, how):
    pair = start_two_nodes(tiny_model_dir, engine_log_dir)
    try:
        t0 = time.monotonic()
        os.killpg(pair.node1.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        code = _wait_exit(pair.node0.proc, timeout=NODE_TIMEOUT_S + 15)
        waited = time.monotonic() - t0
        assert code is not None and code != 0, pair.node0.log_tail()
        assert "node 1" in pair.node0.log_tail() and waited < NODE_TIMEOUT_S + 15
        with pytest.raises(requests.ConnectionError):
            pair.node0.get("/health_generate", timeout=5)
    finally:
        pair.stop()


@pytest.mark.parametrize("how", ["killed", "shut down"])
def test_node_1_exits_with_node_0_non_zero_unless_node_0_shut_down(tiny_model_dir, engine_log_dir, how):
    pair = start_two_nodes(tiny_model_dir, engine_log_dir)
    try:
        os.killpg(pair.node0.proc.pid, signal.SIGKILL if how == "killed" else signal.SIGTERM)
        code = _wait_exit(pair.node1, timeout=20)
        assert code is not None, pair.node1_log.read_text()
        assert (code != 0) if how == "killed" else (code == 0), (code, pair.node1_log.read_text())
    finally:
        pair.stop()


def test_memory_release_and_resume_reach_the_rank_on_node_1(two_nodes, tiny_model_dir):
    node0 = two_nodes.node0
    assert node0.post("/release_memory_occupation", {"tags": ["weights"]}).json() is None
    ranks = node0.post("/weights_checker", {"action": "checksum"}).json()["ranks"]
    empty = hashlib.sha256(b"").digest()[:8]
    assert all(r["checksums"]["model.norm.weight"] == f"{int.from_bytes(empty, 'big'):016x}"
               for r in ranks) and len(ranks) == 2  # storage dropped on both nodes
    assert node0.post("/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert node0.generate({"input_ids": [1, 2, 3]}).status_code == 503  # no contents without a backup
    r = node0.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
    assert r.status_code == 200, r.text
    assert node0.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).status_code == 200
