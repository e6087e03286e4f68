"""A two-engine fleet (real Ray, the real sglang-router, reference engines) per test."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from slime_like.api import launch_fleet

FLEET_YAML = Path(__file__).resolve().parents[2] / "examples" / "own_trainer" / "fleet.yaml"


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    """Two engines of one updatable model behind one router; torn down after the test."""
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    f = launch_fleet(FLEET_YAML, model_path=tiny_model_dir, engine="reference", log_dir=tmp_path)
    yield f
    f.shutdown()
    ray.shutdown()
