"""A trainer (this process) syncs two reference engines (TP=1 and TP=2) over every transport."""

from __future__ import annotations

import itertools

import pytest
from weight_sync_helpers import (
    greedy_continuation,
    model_checksum,
    trainer_model,
)

from slime_like.weights import WeightSync

PROMPT = [1, 72, 101, 108, 108, 111]
_seeds = itertools.count(100)


@pytest.mark.parametrize("transport, load_format", [
    ("distributed", "flattened_bucket"),
    ("distributed", "per_tensor"),
    ("tensor", "flattened_bucket"),
    ("disk", "flattened_bucket"),
])
def test_every_rank_matches_the_trainer_after_a_sync(engines, tiny_model_dir, tmp_path,
                                                     transport, load_format):
    sync = WeightSync([(e.url, e.tp_size) for e in engines], transport=transport,
                      load_format=load_format, update_weight_buffer_size=64 << 10,
                      disk_dir=str(tmp_path / "ckpt"), http_timeout_s=60, group_timeout_s=60)
    try:
        for _ in range(2):  # the second sync reuses the group, buffers and plan
            model = trainer_model(tiny_model_dir, seed=next(_seeds))
            report = sync.update(model)
            expected = model_checksum(model)
            for e in engines:
                assert e.rank_checksums() == [expected] * e.tp_size, e.url
                assert e.weight_version() == report.weight_version
                assert e.greedy(PROMPT, 8) == greedy_continuation(model, PROMPT, 8)
            assert report.transfer["buckets"] > (1 if transport != "disk" else 0)
            assert set(report.flush.values()) == {"flushed"}
    finally:
        sync.close()
