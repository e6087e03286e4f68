"""A sync from FSDP2 shards: real gloo trainer ranks (spawned), real reference engines.

After the sync every engine rank's checksum equals the full-replica model's; the gather
runs bucket by bucket into two buffers on rank 0; a rank that dies mid-gather fails the
sync cleanly (the engines serve on, at their old version).
"""

from __future__ import annotations

import itertools

import pytest
import torch.multiprocessing as mp
from sharded_helpers import sharded_sync_rank
from weight_sync_helpers import greedy_continuation, model_checksum, trainer_model

from slime_like.reference_engine.tp import free_port

PROMPT = [1, 72, 101, 108, 108, 111]
BUCKET = 16 << 10
_seeds = itertools.count(500)


def _run(world: int, engines, model_dir, seed: int, settings: dict, die_after: int = 0):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=sharded_sync_rank, args=(
        r, world, port, [(e.url, e.tp_size) for e in engines], str(model_dir), seed,
        settings, die_after, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        while len(results) < world - (1 if die_after else 0):
            results.append(out.get(timeout=240))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results, [p.exitcode for p in procs]


@pytest.mark.parametrize("world, transport", [(3, "distributed"), (2, "disk")])
def test_engines_match_the_full_replica_after_a_sharded_sync(engines, tiny_model_dir, tmp_path,
                                                             world, transport):
    seed = next(_seeds)
    settings = {"transport": transport, "update_weight_buffer_size": BUCKET,
                "disk_dir": str(tmp_path / "ckpt"), "http_timeout_s": 60,
                "group_timeout_s": 60}
    results, codes = _run(world, engines, tiny_model_dir, seed, settings)
    assert codes == [0] * world, results
    ok = [r for r in results if r[0] == "ok"]
    assert ok, results
    report, stats = ok[0][1], ok[0][2]
    served = sorted(r[1:] for r in results if r[0] == "served")
    assert [n for _, n in served] == [stats["buckets"]] * (world - 1)
    reference = trainer_model(tiny_model_dir, seed)  # the full replica the shards came from
    for e in engines:
        assert e.rank_checksums() == [model_checksum(reference)] * e.tp_size, e.url
        assert e.weight_version() == report["weight_version"]
        assert e.greedy(PROMPT, 6) == greedy_continuation(reference, PROMPT, 6)
    bucket_count = report["transfer"]["buckets"] if transport != "disk" else stats["buckets"]
    assert stats["buckets"] == bucket_count and bucket_count > 2
    # Two bucket buffers (a bucket may exceed BUCKET by one tensor, as the plan allows).
    largest = max(p.numel() * 4 for p in reference.parameters())
    assert stats["buffer_bytes"] <= 2 * max(BUCKET, largest) * 1.1


def test_a_rank_dying_mid_gather_fails_the_sync_cleanly(engines, tiny_model_dir):
    before = [e.weight_version() for e in engines]
    sums = [e.rank_checksums() for e in engines]
    settings = {"transport": "distributed", "update_weight_buffer_size": BUCKET,
                "http_timeout_s": 60, "group_timeout_s": 60}
    results, codes = _run(2, engines, tiny_model_dir, next(_seeds), settings, die_after=2)
    assert codes[1] == 3
    failed = [r for r in results if r[0] == "failed"]
    assert failed, results
    step, message = failed[0][1], failed[0][2]
    assert step == "transfer" and "gathering bucket 3/" in message, message
    for e, version, checksum in zip(engines, before, sums, strict=True):
        assert e.weight_version() == version  # nothing verified under a new version
        assert len(e.greedy(PROMPT, 3)) == 3  # resumed: it serves (partly new weights, under
        assert len(e.rank_checksums()) == len(checksum)  # the old version, until a full sync)
