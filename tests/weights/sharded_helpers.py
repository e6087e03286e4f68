"""Trainer ranks of the sharded-sync tests: real gloo groups in spawned processes."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from weight_sync_helpers import trainer_model

from slime_like.errors import WeightSyncError
from slime_like.weights.sharded import ShardedWeights
from slime_like.weights.sync import WeightSync


def shard(model):
    """FSDP2 over the group: one unit per decoder layer, then the root (as the trainer)."""
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def sharded_sync_rank(rank: int, world: int, port: int, engines: list, model_dir: str,
                      seed: int, settings: dict, die_after: int, out) -> None:
    """One rank: rank 0 syncs the engines from the shards, the others serve its gathers.

    `die_after` > 0: rank 1 exits (os._exit, a real process death) after sending that many
    buckets; the only way to lose a rank at a chosen point of the gather.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model = shard(trainer_model(model_dir, seed))
    source = ShardedWeights(model, bucket_bytes=settings["update_weight_buffer_size"],
                            copies=settings.get("transport", "distributed") != "distributed")
    if rank != 0:
        if die_after and rank == 1:
            real = source._gather_bucket
            sent = []

            def dying(bucket, buf):
                if len(sent) == die_after:
                    os._exit(3)
                sent.append(bucket)
                real(bucket, buf)
            source._gather_bucket = dying
        out.put(("served", rank, source.serve()))
        dist.destroy_process_group()
        return
    sync = WeightSync(engines, **settings)
    try:
        report = sync.update(source, f"sharded-{seed}")
        out.put(("ok", report.as_dict(), source.stats.as_dict()))
    except WeightSyncError as e:
        out.put(("failed", e.step, str(e), source.stats.as_dict()))
    finally:
        source.finish()
        sync.close()
    if not die_after:
        dist.destroy_process_group()
