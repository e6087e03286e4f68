"""Checkpoints: a restored trainer continues exactly; a half-written save is never `latest`."""

from __future__ import annotations

import pytest
import torch

from slime_like.errors import ConfigError
from slime_like.models.tiny import make_tiny_model
from slime_like.trainer.checkpoint import (
    LATEST,
    JobState,
    begin_save,
    commit_save,
    latest_checkpoint,
    load_rank_state,
    save_rank_state,
)
from slime_like.trainer.policy import PolicyTrainer

BATCH = [([3, 4, 5], [6, 7, 8]), ([9, 10], [11, 12, 13])]


def _step(policy: PolicyTrainer) -> dict:
    return policy.train_step(BATCH, [1.0, -1.0])


def test_a_restored_trainer_takes_the_same_next_step_as_the_original(tmp_path, tiny_model_dir):
    original = PolicyTrainer(tiny_model_dir, lr=1e-2)
    _step(original)
    tmp = begin_save(tmp_path / "ckpt", step=0)
    save_rank_state(original.model, original.optimizer, 0, tmp)
    path = commit_save(tmp, JobState(step=0, weight_version=2, data={"kind": "toy"}))
    expected = _step(original)

    resumed = PolicyTrainer(tiny_model_dir, lr=1e-2, seed=99)
    found = latest_checkpoint(tmp_path / "ckpt")
    assert found is not None and found.path == path
    assert found.state == JobState(step=0, weight_version=2, data={"kind": "toy"})
    load_rank_state(resumed.model, resumed.optimizer, 0, found.path)
    # the optimizer's moments came back too: the next step lands on the same weights
    got = _step(resumed)
    assert got == pytest.approx(expected)
    for (name, a), (_, b) in zip(original.model.named_parameters(),
                                 resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_rng_state_is_restored(tmp_path, tiny_model_dir):
    policy = PolicyTrainer(tiny_model_dir)
    tmp = begin_save(tmp_path, step=3)
    torch.manual_seed(11)
    save_rank_state(policy.model, policy.optimizer, 0, tmp)
    commit_save(tmp, JobState(step=3, weight_version=4))
    expected = torch.rand(4)
    torch.manual_seed(0)
    load_rank_state(policy.model, policy.optimizer, 0, tmp_path / "iter_0000003")
    assert torch.equal(torch.rand(4), expected)


def test_an_unfinished_save_leaves_the_previous_checkpoint_latest(tmp_path, tiny_model_dir):
    policy = PolicyTrainer(tiny_model_dir)
    tmp = begin_save(tmp_path, step=1)
    save_rank_state(policy.model, policy.optimizer, 0, tmp)
    commit_save(tmp, JobState(step=1, weight_version=2))
    begin_save(tmp_path, step=3)  # killed while the ranks were writing step 3
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.state.step == 1
    assert (tmp_path / LATEST).read_text() == "1\n"


def test_load_dir_without_checkpoints_means_start_afresh_but_a_broken_one_fails(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing-yet") is None
    (tmp_path / LATEST).write_text("5\n")
    with pytest.raises(ConfigError, match=r"^--load: .* names step 5, but .*iter_0000005/"
                                          r"job_state\.json is missing$"):
        latest_checkpoint(tmp_path)


def test_a_checkpoint_of_another_model_is_refused_naming_load(tmp_path, tiny_model_dir):
    other = make_tiny_model(tmp_path / "other", layers=1)
    small = PolicyTrainer(other)
    tmp = begin_save(tmp_path / "ckpt", step=0)
    save_rank_state(small.model, small.optimizer, 0, tmp)
    commit_save(tmp, JobState(step=0, weight_version=1))
    policy = PolicyTrainer(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"^--load: .* holds another model's weights"):
        load_rank_state(policy.model, policy.optimizer, 0, tmp_path / "ckpt" / "iter_0000000")
