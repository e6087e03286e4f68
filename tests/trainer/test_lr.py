"""--lr: the trainer's AdamW step size (its first step moves each weight by about lr)."""

from __future__ import annotations

import torch

from slime_like.models.tiny import make_tiny_model
from slime_like.trainer.policy import PolicyTrainer


def _largest_move(model_dir, lr: float) -> float:
    trainer = PolicyTrainer(model_dir, lr=lr, seed=0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step([([1, 2, 3], [4, 5]), ([1, 2], [6, 7])], [1.0, -1.0])
    return max(float((p.detach() - before[n]).abs().max())
               for n, p in trainer.model.named_parameters())


def test_the_first_step_moves_weights_by_about_lr(tmp_path):
    model = make_tiny_model(tmp_path / "m", layers=1, hidden=32, seed=0)
    for lr in (1e-2, 1e-4):
        assert torch.isclose(torch.tensor(_largest_move(model, lr)), torch.tensor(lr), rtol=0.05)
