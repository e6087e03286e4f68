"""The seed's API (the façade) and WeightSync land the same bytes in the same engine."""

from __future__ import annotations

import torch
from weight_sync_helpers import model_checksum, trainer_model

from slime_like.weights import SGLangWeightSyncScheme, WeightSync, get_model_metadata

BUCKET = 64 << 10  # several buckets for the tiny model


def test_facade_and_weight_sync_leave_identical_engine_checksums(engines, tiny_model_dir):
    engine = engines[0]
    policy = trainer_model(tiny_model_dir, seed=501)
    sync = WeightSync([(engine.url, 1)], update_weight_buffer_size=BUCKET, http_timeout_s=60,
                      group_timeout_s=60)
    try:
        sync.update(policy)
        through_weight_sync = engine.rank_checksums()
    finally:
        sync.close()
    assert through_weight_sync == [model_checksum(policy)]

    trained = trainer_model(tiny_model_dir, seed=502)  # the engine holds other weights first
    scheme = SGLangWeightSyncScheme(engine.url, num_gpus=1, device=0,
                                    update_weight_buffer_size=BUCKET)
    sender = scheme.create_sender()
    try:
        sender.register_model(trained)
        sender.init_all_workers_group(get_model_metadata(trained))
        sender.update_weights()
        assert engine.rank_checksums() == [model_checksum(trained)]
        # A training step changes the registered parameters in place: the next update sends
        # the new values through the walk cached at register_model.
        with torch.no_grad():
            for mine, theirs in zip(trained.parameters(), policy.parameters(), strict=True):
                mine.copy_(theirs)
        sender.update_weights()
        assert engine.rank_checksums() == through_weight_sync
        # Every update handed WeightSync the same metadata list: checked once, not per call.
        assert sender.sync._checked is sender._source.metadata()
    finally:
        sender.shutdown()
