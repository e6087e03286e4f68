"""GRPO pieces: group-normalised advantages and the policy-gradient loss on packed samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within each consecutive group of `group_size` samples."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.view(-1).tolist()


@dataclass
class PackedBatch:
    """Prompt+completion rows, right-padded, with a mask over completion tokens."""

    input_ids: torch.Tensor        # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool: position t holds a generated token
    advantages: torch.Tensor       # [B]


def pack(samples: Sequence[tuple[list[int], list[int]]], advantages: Sequence[float],
         pad_id: int = 0) -> PackedBatch:
    """samples: (prompt_ids, output_ids) pairs -> a padded batch."""
    width = max(len(p) + len(o) for p, o in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, (prompt, output) in enumerate(samples):
        row = prompt + output
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(prompt): len(row)] = True
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
