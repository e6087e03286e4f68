"""A two-engine fleet (real Ray, the real sglang-router, reference engines) per test, on one
local Ray cluster per module."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from slime_like.api import launch_fleet

FLEET_YAML = Path(__file__).resolve().parents[2] / "examples" / "own_trainer" / "fleet.yaml"


@pytest.fixture(scope="module")
def fleet_ray():
    """One local Ray cluster for the module's fleets (each test launches and shuts down its
    own; a fleet's shutdown releases its placement group, so the next one fits)."""
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture
def fleet(tmp_path, tiny_model_dir, fleet_ray):
    """Two engines of one updatable model behind one router; torn down after the test."""
    f = launch_fleet(FLEET_YAML, model_path=tiny_model_dir, engine="reference", log_dir=tmp_path)
    yield f
    f.shutdown()
