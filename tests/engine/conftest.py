"""Fixtures for engine tests: reference-engine configs."""

from __future__ import annotations

import pytest

from slime_like.engine.server import EngineConfig


@pytest.fixture
def reference_config(tiny_model_dir, tmp_path):
    """EngineConfig for a reference engine on the tiny model, on loopback, logging to tmp."""
    def make(**kw) -> EngineConfig:
        base = dict(model_path=str(tiny_model_dir), program="reference", host="127.0.0.1",
                    log_dir=str(tmp_path / "engines"), startup_timeout=120.0)
        base.update(kw)
        return EngineConfig(**base)
    return make
