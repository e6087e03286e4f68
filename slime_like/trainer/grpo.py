"""GRPO pieces: group-normalised advantages and the policy-gradient loss on packed samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slime_like.config.slices import OffPolicySettings


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within each consecutive group of `group_size` samples."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.view(-1).tolist()


@dataclass
class PackedBatch:
    """Prompt+completion rows, right-padded, with a mask over the completion tokens to train."""

    input_ids: torch.Tensor        # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool: position t holds a model token to train on
    advantages: torch.Tensor       # [B]

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(self.input_ids.to(device), self.completion_mask.to(device),
                           self.advantages.to(device))


def pack(samples: Sequence[tuple[list[int], list[int]]], advantages: Sequence[float],
         pad_id: int = 0, loss_masks: Sequence[Sequence[int] | None] | None = None) -> PackedBatch:
    """samples: (prompt_ids, output_ids) pairs -> a padded batch.

    `loss_masks` (one per sample, 1 per output token the model produced, 0 for tokens an
    environment or tool inserted; None = all the model's) keeps inserted tokens out of the
    loss while they stay in the context the model's later tokens were conditioned on.
    """
    width = max(len(p) + len(o) for p, o in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, (prompt, output) in enumerate(samples):
        row = prompt + output
        ids[i, : len(row)] = torch.tensor(row)
        lm = loss_masks[i] if loss_masks is not None else None
        if lm is None:
            mask[i, len(prompt): len(row)] = True
        else:
            if len(lm) != len(output):
                raise ValueError(f"sample {i}: loss mask of {len(lm)} for {len(output)} output tokens")
            mask[i, len(prompt): len(row)] = torch.tensor(lm, dtype=torch.bool)
    return PackedBatch(ids, mask, torch.tensor(advantages, dtype=torch.float32))


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logprob of token t given tokens < t, at every position t >= 1 ([B, T], 0 at t=0)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def policy_gradient_loss(logprobs: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """-mean over completion tokens of advantage * logprob (on-policy GRPO, one step)."""
    mask = batch.completion_mask.float()
    per_token = -batch.advantages[:, None] * logprobs * mask
    return per_token.sum() / mask.sum().clamp(min=1.0)


def off_policy_loss(logprobs: torch.Tensor, batch: PackedBatch, rollout_logprobs: torch.Tensor,
                    settings: OffPolicySettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy-gradient loss corrected for samples the engines made (slime's meaning).

    `rollout_logprobs` ([B, T], laid out like `logprobs`) are the engines' behaviour
    log-probabilities; the trainer's own before the step are `logprobs` detached (one
    optimiser step per batch). Per model token, with A the advantage:

    - `use_rollout_logprobs`: ratio r = exp(logp - rollout_logp), PPO-clipped to
      [1 - eps_clip, 1 + eps_clip_high]: a token whose clipped side is the smaller
      objective (A > 0 and r above, A < 0 and r below the range) gets no gradient;
    - `use_tis`: weight clamp(exp(logp_trainer - rollout_logp), tis_clip_low, tis_clip),
      no gradient through it, multiplied onto the token's loss.

    The loss is written -A x w x logp with w the (detached) product of the two: its
    gradient is slime's -A x r x tis x grad(logp) for unclipped tokens, and at r = w = 1
    it is `policy_gradient_loss` exactly, value and gradient.
    """
    mask = batch.completion_mask
    tokens = mask.float().sum().clamp(min=1.0)
    current = logprobs.detach()
    behaviour = torch.where(mask, rollout_logprobs, current)  # outside the loss: ratio 1

    def mean(x: torch.Tensor) -> float:
        return float((x.float() * mask).sum() / tokens)

    advantages = batch.advantages[:, None]
    weight = torch.ones_like(current)
    metrics = {"train_rollout_logprob_abs_diff": mean((current - behaviour).abs())}
    if settings.use_rollout_logprobs:
        ratio = torch.exp(current - behaviour)
        clipped = (((advantages > 0) & (ratio > 1.0 + settings.clip_high))
                   | ((advantages < 0) & (ratio < 1.0 - settings.eps_clip)))
        weight = ratio * (~clipped)
        metrics.update(ratio_mean=mean(ratio), ppo_clipfrac=mean(clipped),
                       ppo_kl=mean(behaviour - current))
    if settings.use_tis:
        tis = torch.exp(current - behaviour)
        truncated = tis.clamp(min=settings.tis_clip_low, max=settings.tis_clip)
        weight = weight * truncated
        metrics.update(tis_mean=mean(tis), tis_clipfrac=mean(truncated != tis))
    per_token = -advantages * weight * logprobs * mask.float()
    return per_token.sum() / tokens, metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from log-probabilities of sampled tokens.

    k1 = log p - log p_ref (unbiased, high variance); k2 = k1^2 / 2; low_var_kl (k3) =
    exp(-k1) - 1 + k1, clamped to [-10, 10] as slime does.
    """
    k1 = logprobs - ref_logprobs
    if kind == "k1":
        return k1
    if kind == "k2":
        return 0.5 * k1 * k1
    if kind == "low_var_kl":
        return torch.clamp(torch.exp(-k1) - 1 + k1, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r} (k1, k2, low_var_kl)")


def ref_logprob_rows(samples: Sequence[tuple[list[int], list[int]]],
                     ref: Sequence[Sequence[float]], width: int,
                     what: str = "reference") -> torch.Tensor:
    """Per-token log-probabilities (a reference model's, the engines') laid out like
    `pack`'s completion positions ([B, T])."""
    out = torch.zeros((len(samples), width), dtype=torch.float32)
    for i, ((prompt, output), row) in enumerate(zip(samples, ref, strict=True)):
        if len(row) != len(output):
            raise ValueError(f"sample {i}: {len(row)} {what} logprobs for {len(output)} tokens")
        out[i, len(prompt): len(prompt) + len(output)] = torch.tensor(row, dtype=torch.float32)
    return out
