"""The job's checkpoint policy: when to save, and how a save becomes a checkpoint.

Trainer ranks write their part into a temporary directory; the driver adds the job state
(step, weight version, whether the engines served it, the prompt source's position) and
renames the directory into place (see trainer/checkpoint.py), so a checkpoint is whole or
absent.
"""

from __future__ import annotations

import logging
from pathlib import Path

from slime_like.config.slices import CheckpointSettings
from slime_like.rollout.prompts import PromptSource
from slime_like.trainer.checkpoint import JobState, begin_save, commit_save
from slime_like.trainer.group import TrainerGroup

logger = logging.getLogger("slime_like.train")


def save_due(settings: CheckpointSettings, step: int, num_steps: int) -> bool:
    """Every --save-interval steps, and after the last step (slime's rule)."""
    if not settings.save:
        return False
    return bool(settings.save_interval and (step + 1) % settings.save_interval == 0) \
        or step == num_steps - 1


def save_checkpoint(root: str, step: int, trainer: TrainerGroup, version: int, synced: bool,
                    source: PromptSource) -> Path:
    """Trainer ranks write into a temporary directory; the driver adds the job state and
    renames it into place."""
    tmp = begin_save(root, step)
    trainer.save_checkpoint(str(tmp))
    path = commit_save(tmp, JobState(step, version, synced, source.state_dict()))
    logger.info("saved step %d (weight version %d) to %s", step, version, path)
    return path
