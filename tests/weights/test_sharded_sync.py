"""A sync from FSDP2 shards: real gloo trainer ranks (spawned), real reference engines.

After the sync every engine rank's checksum equals the full-replica model's; the gather
runs bucket by bucket into two buffers on rank 0; a rank that dies mid-gather fails the
sync cleanly (the engines serve on, at their old version).
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.multiprocessing as mp
from sharded_helpers import SCALE, sharded_sync_rank
from weight_sync_helpers import greedy_continuation, model_checksum, trainer_model

from slime_like.cluster.ports import free_port

PROMPT = [1, 72, 101, 108, 108, 111]
BUCKET = 16 << 10
_seeds = itertools.count(500)


def _run(world: int, engines, model_dir, seed: int, settings: dict, die_after: int = 0,
         until: int | None = None, check=None):
    """Spawn the ranks; `check(engines, k)` runs when rank 0 reports its sync k, before it
    changes its weights for the next one."""
    ctx = mp.get_context("spawn")
    out, ack = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=sharded_sync_rank, args=(
        r, world, port, [(e.url, e.tp_size) for e in engines], str(model_dir), seed,
        settings, die_after, out, ack)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        while len(results) < (until or world - (1 if die_after else 0)):
            results.append(out.get(timeout=240))
            if check is not None and results[-1][0] == "ok":
                check(engines, sum(r[0] == "ok" for r in results) - 1)
                ack.put(True)
    finally:
        # Polled, not joined: a rank that synced over `tensor` started torch's shared-memory
        # manager (`torch_shm_manager`), which inherits the rank's end of the pipe `join`
        # waits on and outlives the rank by about a minute here.
        deadline = time.monotonic() + 60
        for p in procs:
            while p.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.is_alive():
                p.kill()
    return results, [p.exitcode for p in procs]


def test_engines_match_the_full_replica_after_sharded_syncs_over_every_transport(
        engines, tiny_model_dir, tmp_path):
    seed, world = next(_seeds), 3  # three ranks: the last shard of odd rows is short
    transports = ["distributed", "tensor", "disk"]
    settings = {"transports": transports, "sync": {
        "update_weight_buffer_size": BUCKET, "disk_dir": str(tmp_path / "ckpt"),
        "http_timeout_s": 60, "group_timeout_s": 60}}
    results, codes = _run(world, engines, tiny_model_dir, seed, settings, until=world
                          * len(transports), check=lambda e, k: _check_engines(
                              e, tiny_model_dir, seed, k))
    assert codes == [0] * world, results
    synced = [r for r in results if r[0] == "ok"]
    assert len(synced) == len(transports)
    for k, (_, report, stats) in enumerate(synced):
        assert stats["buckets"] > 2
        if transports[k] == "distributed":
            assert report["transfer"]["buckets"] == stats["buckets"]
            assert stats["overlap"] is not None
        # Two bucket buffers (a bucket may exceed BUCKET by one tensor, as the plan allows).
        largest = max(p.numel() * 4 for p in trainer_model(tiny_model_dir, seed).parameters())
        assert stats["buffer_bytes"] <= 2 * max(BUCKET, largest)
    served = sorted(r[2] for r in results if r[0] == "served")
    assert served == sorted([s["buckets"] for _, _, s in synced] * (world - 1))


def _check_engines(engines, model_dir, seed: int, k: int) -> None:
    """After sync k: every engine rank holds the full replica scaled k times."""
    reference = trainer_model(model_dir, seed)
    with torch.no_grad():
        for p in reference.parameters():
            for _ in range(k):
                p.mul_(SCALE)
    for e in engines:
        assert e.rank_checksums() == [model_checksum(reference)] * e.tp_size, (e.url, k)
        assert e.weight_version() == f"sharded-{seed}-{k}"
        assert e.greedy(PROMPT, 4) == greedy_continuation(reference, PROMPT, 4)


def test_a_rank_dying_mid_gather_fails_the_sync_cleanly(engines, tiny_model_dir):
    before = [e.weight_version() for e in engines]
    sums = [e.rank_checksums() for e in engines]
    settings = {"sync": {"transport": "distributed", "update_weight_buffer_size": BUCKET,
                         "http_timeout_s": 60, "group_timeout_s": 60}}
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
