"""The schedules keep start-up's heap out of the collector's scans while steps run."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from slime_like.job.schedules import run_schedule


class _StepsOnly:
    """A job reduced to what `run_schedule` reads in the sync schedule: its steps."""

    def __init__(self, num_steps: int, fail_at: int | None = None):
        self.settings = SimpleNamespace(asynchrony=SimpleNamespace(mode="sync"),
                                        num_steps=num_steps)
        self.start_step = 0
        self.fail_at = fail_at
        self.frozen_during: list[int] = []

    def step(self, step: int) -> None:
        self.frozen_during.append(gc.get_freeze_count())
        if step == self.fail_at:
            raise RuntimeError(f"step {step} failed")


def test_start_up_objects_are_frozen_while_steps_run_and_released_after():
    start_up = [object() for _ in range(1000)]  # what start-up built, still referenced
    job = _StepsOnly(num_steps=3)
    run_schedule(job)
    assert len(job.frozen_during) == 3
    assert all(count >= len(start_up) for count in job.frozen_during)
    assert gc.get_freeze_count() == 0  # shutting down frees them as usual


def test_a_failing_step_still_unfreezes_the_heap():
    job = _StepsOnly(num_steps=3, fail_at=1)
    with pytest.raises(RuntimeError, match="step 1 failed"):
        run_schedule(job)
    assert job.frozen_during and job.frozen_during[0] > 0
    assert gc.get_freeze_count() == 0
