"""The KL estimators of --kl-loss-type and the KL loss term of a train step."""

from __future__ import annotations

import math

import pytest
import torch

from slime_like.models.tiny import make_tiny_model
from slime_like.trainer.grpo import kl_penalty, ref_logprob_rows
from slime_like.trainer.policy import PolicyTrainer


def test_each_estimator_matches_its_formula():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    k1 = lp - ref
    assert torch.allclose(kl_penalty(lp, ref, "k1"), k1)
    assert torch.allclose(kl_penalty(lp, ref, "k2"), 0.5 * k1 ** 2)
    assert torch.allclose(kl_penalty(lp, ref, "low_var_kl"), torch.exp(-k1) - 1 + k1)
    assert kl_penalty(lp, lp, "low_var_kl").abs().max() == 0  # identical policies: no KL
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(lp, ref, "k9")


def test_reference_rows_line_up_with_completion_positions():
    rows = ref_logprob_rows([([1, 2], [3, 4]), ([5], [6])], [[-0.1, -0.2], [-0.3]], width=4)
    assert torch.allclose(rows, torch.tensor([[0, 0, -0.1, -0.2], [0, -0.3, 0, 0]]))
    with pytest.raises(ValueError, match="1 reference logprobs for 2 tokens"):
        ref_logprob_rows([([1], [2, 3])], [[-0.1]], width=3)


def test_kl_loss_is_added_only_with_a_coefficient(tmp_path):
    model = make_tiny_model(tmp_path / "m", layers=1, hidden=32, seed=0)
    samples = [([1, 2, 3], [4, 5]), ([1, 2], [6, 7])]
    trainer = PolicyTrainer(model, lr=1e-3, seed=0)
    same = trainer.completion_logprobs(samples)
    plain = trainer.train_step(samples, [1.0, -1.0])
    assert "kl_loss" not in plain
    trainer = PolicyTrainer(model, lr=1e-3, seed=0)
    with_kl = trainer.train_step(samples, [1.0, -1.0], ref_logprobs=same, kl_loss_coef=0.5,
                                 kl_loss_type="low_var_kl")
    # before the step the policy is the reference: KL 0, same loss as without the term
    assert with_kl["kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert math.isclose(with_kl["loss"], plain["loss"], abs_tol=1e-6)
    moved = [[lp - 0.3 for lp in row] for row in same]
    again = PolicyTrainer(model, lr=1e-3, seed=0).train_step(
        samples, [1.0, -1.0], ref_logprobs=moved, kl_loss_coef=0.5, kl_loss_type="k1")
    assert again["kl_loss"] == pytest.approx(0.3, abs=1e-5)
    assert again["loss"] == pytest.approx(plain["loss"] + 0.5 * 0.3, abs=1e-5)


def test_temperature_scales_the_recomputed_logprobs(tmp_path):
    model = make_tiny_model(tmp_path / "m", layers=1, hidden=32, seed=0)
    trainer = PolicyTrainer(model, lr=1e-3, seed=0)
    samples = [([1, 2, 3], [4, 5])]
    at1, at_half = trainer.completion_logprobs(samples), trainer.completion_logprobs(
        samples, temperature=0.5)
    assert at1 != at_half


def test_the_train_step_scores_tokens_at_the_rollout_temperature(tmp_path):
    """Samples drawn at temperature T are trained on under logits / T, as slime does: the
    step's log-probabilities then equal the trainer's own at T (zero KL against them)."""
    model = make_tiny_model(tmp_path / "m", layers=1, hidden=32, seed=0)
    samples = [([1, 2, 3], [4, 5]), ([1, 2], [6, 7])]
    at_t = PolicyTrainer(model, lr=1e-3, seed=0).completion_logprobs(samples, temperature=2.0)
    kl = {"ref_logprobs": at_t, "kl_loss_coef": 0.5, "kl_loss_type": "k1"}
    scaled = PolicyTrainer(model, lr=1e-3, seed=0).train_step(samples, [1.0, -1.0],
                                                              temperature=2.0, **kl)
    assert scaled["kl_loss"] == pytest.approx(0.0, abs=1e-6)
    unscaled = PolicyTrainer(model, lr=1e-3, seed=0).train_step(samples, [1.0, -1.0], **kl)
    assert abs(unscaled["kl_loss"]) > 1e-3
