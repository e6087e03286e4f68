"""Errors cross process boundaries (Ray pickles them) with their message and fields intact."""

from __future__ import annotations

import pickle

import pytest

from slime_like import errors


@pytest.mark.parametrize("err", [
    errors.ConfigError("sglang[0].num_gpus", "must be > 0, got 0"),
    errors.EngineError("http://h:1", "/pause_generation", 400, "bad", reason="x"),
    errors.LaunchError("engine0 exited", "log tail"),
    errors.WeightSyncError("transfer", "boom", "http://h:1"),
    errors.WeightMetadataError("shape mismatch for 'w'", "http://h:1"),
    errors.UnsafePayloadError("blocked os.system", "os.system"),
    errors.PlacementError("no GPUs"),
    errors.RouterError("router down"),
])
def test_every_error_survives_pickling_with_its_message_and_fields(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert back.__dict__ == err.__dict__
