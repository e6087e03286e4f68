"""The loss's off-policy correction: --use-rollout-logprobs (PPO ratio against the engines'
log-probabilities, clipped) and --use-tis (truncated importance sampling), slime's meaning."""

from __future__ import annotations

import math

import pytest
import torch

from slime_like.config.slices import OffPolicySettings
from slime_like.models.tiny import make_tiny_model
from slime_like.trainer.grpo import token_logprobs
from slime_like.trainer.policy import PolicyTrainer

# Two plain samples and a multi-turn one whose tokens 2 and 3 a tool inserted.
SAMPLES = [([1, 2, 3], [4, 5, 6, 7]), ([1, 2], [8, 9, 10, 11]), ([3, 4], [5, 6, 7, 8])]
ADVANTAGES = [1.0, -1.0, 0.5]
MASKS = [None, None, [1, 0, 0, 1]]
NO_CLIP = 1e9  # gradients compared before clip_grad_norm_ could scale them


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("off_policy")
    return (make_tiny_model(root / "policy", layers=1, hidden=32, seed=0),
            make_tiny_model(root / "behaviour", layers=1, hidden=32, seed=1))


def _engine_view(logprobs: list[list[float]]) -> list[list[float]]:
    """What the engines report: the tool's tokens carry 0.0."""
    return [[0.0 if m is not None and not m[k] else lp for k, lp in enumerate(row)]
            for row, m in zip(logprobs, MASKS, strict=True)]


def _step(model_dir, **kwargs) -> tuple[dict[str, float], list[torch.Tensor]]:
    trainer = PolicyTrainer(model_dir, lr=0.0, seed=0)
    metrics = trainer.train_step(SAMPLES, ADVANTAGES, NO_CLIP, loss_masks=MASKS, **kwargs)
    return metrics, [p.grad.clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("settings", [
    OffPolicySettings(use_rollout_logprobs=True),
    OffPolicySettings(use_tis=True),
    OffPolicySettings(use_rollout_logprobs=True, use_tis=True, tis_clip=1.5, tis_clip_low=0.5),
], ids=["rollout-logprobs", "tis", "both"])
def test_rollout_logprobs_equal_to_the_trainers_own_leave_todays_loss(model_dirs, settings):
    policy_dir, _ = model_dirs
    own = _engine_view(PolicyTrainer(policy_dir, lr=0.0).completion_logprobs(SAMPLES))
    today, today_grads = _step(policy_dir)
    corrected, grads = _step(policy_dir, rollout_logprobs=own, off_policy=settings)
    assert corrected["loss"] == pytest.approx(today["loss"], abs=1e-6)
    for g, want in zip(grads, today_grads, strict=True):
        assert torch.allclose(g, want, atol=1e-6)
    assert corrected["train_rollout_logprob_abs_diff"] < 1e-5
    if settings.use_rollout_logprobs:
        assert corrected["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert corrected["ppo_clipfrac"] == 0.0
    if settings.use_tis:
        assert corrected["tis_mean"] == pytest.approx(1.0, abs=1e-5)
        assert corrected["tis_clipfrac"] == 0.0
    # nothing set: the same call is today's loss
    off, off_grads = _step(policy_dir, rollout_logprobs=own, off_policy=OffPolicySettings())
    assert off == today and all(torch.equal(a, b) for a, b in zip(off_grads, today_grads,
                                                                    strict=True))


def _slime_loss(model_dir, behaviour: list[list[float]], s: OffPolicySettings):
    """slime's form, written out per token: max(-A r, -A clip(r)) x tis over model tokens,
    r = exp(logp - behaviour) with autograd; returns (loss, gradients, per-token stats)."""
    trainer = PolicyTrainer(model_dir, lr=0.0, seed=0)
    total, tokens, stats = 0.0, 0, []
    for (prompt, output), adv, mask, row in zip(SAMPLES, ADVANTAGES, MASKS, behaviour,
                                                strict=True):
        ids = torch.tensor([prompt + output])
        lp = token_logprobs(trainer.model(ids), ids)[0, len(prompt):]
        for k in range(len(output)):
            if mask is not None and not mask[k]:
                continue
            old = float(lp[k].detach())
            ratio = torch.exp(lp[k] - row[k]) if s.use_rollout_logprobs else torch.exp(
                lp[k] - lp[k].detach())
            clip = torch.clamp(ratio, 1 - s.eps_clip, 1 + s.clip_high)
            term = torch.maximum(-adv * ratio, -adv * clip)
            tis = math.exp(old - row[k])
            if s.use_tis:
                term = term * min(max(tis, s.tis_clip_low), s.tis_clip)
            total = total + term
            tokens += 1
            r, c = float(ratio.detach()), float(clip.detach())
            stats.append((r, -adv * c > -adv * r, tis))
    (total / tokens).backward()
    return [p.grad.clone() for p in trainer.model.parameters()], stats


@pytest.mark.parametrize("settings", [
    OffPolicySettings(use_rollout_logprobs=True, eps_clip=0.2, eps_clip_high=0.28),
    OffPolicySettings(use_tis=True, tis_clip=2.0, tis_clip_low=0.0),
    OffPolicySettings(use_rollout_logprobs=True, use_tis=True, tis_clip=1.2, tis_clip_low=0.8),
], ids=["rollout-logprobs", "tis", "both"])
def test_behaviour_of_other_weights_is_corrected_as_slime_does(model_dirs, settings):
    """Samples from other weights: the gradient is slime's PPO-clip x TIS loss's."""
    policy_dir, behaviour_dir = model_dirs
    behaviour = _engine_view(PolicyTrainer(behaviour_dir, lr=0.0).completion_logprobs(SAMPLES))
    metrics, grads = _step(policy_dir, rollout_logprobs=behaviour, off_policy=settings)
    want_grads, stats = _slime_loss(policy_dir, behaviour, settings)
    for g, want in zip(grads, want_grads, strict=True):
        assert torch.allclose(g, want, atol=1e-5, rtol=1e-4)
    today, today_grads = _step(policy_dir)
    assert any(not torch.allclose(g, t, atol=1e-5) for g, t in zip(grads, today_grads,
                                                                      strict=True))
    n = len(stats)
    if settings.use_rollout_logprobs:
        assert metrics["ratio_mean"] == pytest.approx(sum(r for r, _, _ in stats) / n, rel=1e-5)
        assert metrics["ppo_clipfrac"] == pytest.approx(sum(c for _, c, _ in stats) / n)
        assert 0 < metrics["ppo_clipfrac"] < 1  # the weights differ enough to clip some
    if settings.use_tis:
        clipped = [t for _, _, t in stats if not settings.tis_clip_low <= t <= settings.tis_clip]
        assert metrics["tis_mean"] == pytest.approx(sum(t for _, _, t in stats) / n, rel=1e-5)
        assert metrics["tis_clipfrac"] == pytest.approx(len(clipped) / n)


def test_tis_weights_are_clamped_at_both_bounds(model_dirs):
    """Behaviour log-probabilities shifted per token so exp(trainer - engine) lands above
    --tis-clip, inside, and below --tis-clip-low: the loss is the hand-weighted one."""
    policy_dir, _ = model_dirs
    trainer = PolicyTrainer(policy_dir, lr=0.0)
    own = trainer.completion_logprobs(SAMPLES)
    shifts = [-1.0, 0.0, 0.5, 2.0]  # weights e^1, 1, e^-0.5, e^-2 before the clamp
    behaviour = _engine_view([[lp + shifts[k % 4] for k, lp in enumerate(row)] for row in own])
    s = OffPolicySettings(use_tis=True, tis_clip=2.0, tis_clip_low=0.3)
    metrics, _ = _step(policy_dir, rollout_logprobs=behaviour, off_policy=s)
    total, tokens, clamped, raw = 0.0, 0, 0, 0.0
    for row, adv, mask in zip(own, ADVANTAGES, MASKS, strict=True):
        for k, lp in enumerate(row):
            if mask is not None and not mask[k]:
                continue
            tis = math.exp(-shifts[k % 4])
            weight = min(max(tis, 0.3), 2.0)
            assert weight in (2.0, 1.0, pytest.approx(math.exp(-0.5)), 0.3)
            clamped += weight != tis
            raw += tis
            total += -adv * weight * lp
            tokens += 1
    assert metrics["loss"] == pytest.approx(total / tokens, abs=1e-5)
    assert metrics["tis_clipfrac"] == pytest.approx(clamped / tokens)
    assert metrics["tis_mean"] == pytest.approx(raw / tokens, rel=1e-5)


def test_the_correction_needs_the_engines_logprobs(model_dirs):
    trainer = PolicyTrainer(model_dirs[0], lr=0.0)
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        trainer.train_step(SAMPLES, ADVANTAGES, off_policy=OffPolicySettings(use_tis=True))
    with pytest.raises(ValueError, match="sample 0: 1 rollout logprobs for 4 tokens"):
        trainer.train_step(SAMPLES, ADVANTAGES, rollout_logprobs=[[0.0], [0.0], [0.0]],
                           off_policy=OffPolicySettings(use_tis=True))
