"""--train-backend fsdp end to end on CPU: two FSDP2 trainer ranks (gloo) behind real Ray,
the real router and a reference engine; saved at world size 2, resumed at world size 1, and
the same reward curve as the full-replica (ddp) trainer for the same seed.

Every sync gathers the shards from both ranks into rank 0's buffers; the job's own check
compares the engine's log-probabilities of every step's samples with the (sharded)
trainer's, so a sync that sent wrong bytes would fail the step.
"""

from __future__ import annotations

import json

import pytest
import ray

from slime_like.config.parse import parse_args
from slime_like.train import train


@pytest.fixture
def fresh_ray():
    yield
    if ray.is_initialized():
        ray.shutdown()


def _steps(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Every sample seeded (--rollout-seed + its index): two runs whose weights agree draw the
# same samples, so their reward curves can be compared.
SEEDED = ("--sglang-enable-deterministic-inference",)


def _job(run_dir, *flags: str, backend: str = "fsdp") -> int:
    args = parse_args(["--config", "configs/quickstart.yaml", "--output-dir", str(run_dir),
                       "--train-backend", backend, "--num-gpus-per-node", "3",
                       "--rollout-num-gpus", "1", "--rollout-batch-size", "4",
                       "--update-weight-buffer-size", str(64 << 10), *flags])
    return train(args)  # the test's three jobs share one Ray cluster (fresh_ray stops it)


def test_fsdp_job_keeps_logprobs_exact_matches_ddp_and_resumes_at_another_world_size(
        tmp_path, fresh_ray):
    ckpt = tmp_path / "ckpt"
    assert _job(tmp_path / "ws2", "--actor-num-gpus-per-node", "2", "--num-rollout", "2",
                "--save", str(ckpt), "--save-interval", "2", *SEEDED) == 0
    first = _steps(tmp_path / "ws2")
    assert [s["step"] for s in first] == [0, 1]
    for s in first:  # the engine served exactly the gathered shards, at every step
        assert s["logprob_sample_mean_diff_max"] < 1e-4, s
    saved = ckpt / "iter_0000001"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert len(list((saved / "dcp").glob("*.distcp"))) == 2  # one shard file per rank
    version = json.loads((saved / "job_state.json").read_text())["weight_version"]

    # the same seed with the full-replica (ddp) trainer: the same samples, the same rewards
    assert _job(tmp_path / "ddp", "--actor-num-gpus-per-node", "2", "--num-rollout", "2",
                *SEEDED, backend="ddp") == 0
    ddp = _steps(tmp_path / "ddp")
    assert [s["reward_mean"] for s in first] == pytest.approx([s["reward_mean"] for s in ddp],
                                                              abs=1e-9)
    assert [s["loss"] for s in first] == pytest.approx([s["loss"] for s in ddp], abs=1e-4)

    assert _job(tmp_path / "ws1", "--actor-num-gpus-per-node", "1", "--num-rollout", "3",
                "--load", str(ckpt)) == 0
    after = _steps(tmp_path / "ws1")
    assert [s["step"] for s in after] == [2]
    assert after[0]["logprob_sample_mean_diff_max"] < 1e-4, after[0]
    # the resumed engine served the resharded checkpoint as its saved version first
    assert after[0]["sample_weight_versions"] == [version]
    assert after[0]["weight_version"] == version + 1

