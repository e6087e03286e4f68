"""What the job does to a step's samples between the rollout and the trainer: their
staleness, the batch dynamic sampling kept, and which tokens the loss trains on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_like.observe.async_metrics import staleness_histogram
from slime_like.rollout.generate import Sample
from slime_like.rollout.prompts import PromptItem


@dataclass
class Rollout:
    """What one step's rollout produced."""

    prompts: list[PromptItem]
    samples: list[Sample]
    seconds: float  # generation only
    trainer_offloaded: dict = field(default_factory=dict)
    #: what an asynchronous schedule adds to the step's metrics (staleness, drops, waits)
    metrics: dict[str, Any] = field(default_factory=dict)


def staleness_of(samples: list[Sample], trained_version: int) -> dict[str, int]:
    """{age: samples}: how many versions each sample's oldest token is behind the trained
    version (the sync schedule's are all 0)."""
    return {str(age): count for age, count in staleness_histogram(
        trained_version, (min(int(v) for v in s.versions()) for s in samples)).items()}


def kept_batch(groups: list[list[Sample]]) -> tuple[list[PromptItem], list[Sample]]:
    """The prompts and samples of the groups dynamic sampling kept, renumbered in order."""
    prompts, samples = [], []
    for i, group in enumerate(groups):
        first = group[0]
        prompts.append(PromptItem(first.prompt, list(first.prompt_ids), first.label,
                                  dict(first.metadata)))
        for s in group:
            s.prompt_index = i
            samples.append(s)
    return prompts, samples


def train_masks(samples: list[Sample], mask_offpolicy: bool) -> list[list[int]] | None:
    """Per sample, 1 per output token to train on: the model's tokens (a multi-turn
    sample's environment tokens are left out) and, with --mask-offpolicy-in-partial-rollout,
    only the tokens of a partial sample's last weight version."""
    masks = []
    for s in samples:
        mask = s.model_token_mask()
        if mask_offpolicy and s.partial_resubmits and s.mixed:
            newest = s.spans()[-1][0]
            for version, start, end in s.spans():
                if version != newest:
                    mask[start:end] = [0] * (end - start)
        masks.append(mask)
    if all(s.loss_mask is None for s in samples) and all(all(m) for m in masks):
        return None
    return masks
