"""Multi-turn samples: tokens an environment inserted stay in the context, out of the loss."""

from __future__ import annotations

import pytest
import torch

from slime_like.trainer.grpo import pack, policy_gradient_loss, token_logprobs
from slime_like.trainer.policy import PolicyTrainer


def test_pack_marks_only_the_model_tokens_of_a_multi_turn_sample():
    batch = pack([([1, 2], [3, 4, 5, 6]), ([7], [8])], [1.0, -1.0],
                 loss_masks=[[1, 0, 0, 1], None])
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 0, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[False, False, True, False, False, True],
                                              [False, True, False, False, False, False]]
    with pytest.raises(ValueError, match="sample 0: loss mask of 2 for 4 output tokens"):
        pack([([1], [2, 3, 4, 5])], [0.0], loss_masks=[[1, 1]])


def test_the_train_step_loss_is_the_model_tokens_loss(tiny_model_dir):
    """The loss the trainer steps on is -advantage x mean logprob over the model's tokens."""
    trainer = PolicyTrainer(tiny_model_dir, lr=0.0)
    samples = [([10, 11, 12], [20, 21, 22, 23, 24])]
    mask = [1, 1, 0, 0, 1]  # tokens 22, 23 came from a tool
    with torch.no_grad():
        ids = torch.tensor([samples[0][0] + samples[0][1]])
        lp = token_logprobs(trainer.model(ids), ids)[0]
    model_positions = [3 + i for i, m in enumerate(mask) if m]
    expected = -(0.5 * lp[model_positions]).mean().item()
    metrics = trainer.train_step(samples, [0.5], loss_masks=[mask])
    assert metrics["loss"] == pytest.approx(expected, abs=1e-6)
    unmasked = policy_gradient_loss(lp[None], pack(samples, [0.5])).item()
    assert unmasked != pytest.approx(expected, abs=1e-6)  # the mask changed what was trained
