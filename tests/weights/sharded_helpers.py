"""Trainer ranks of the sharded-sync tests: real gloo groups in spawned processes."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from weight_sync_helpers import trainer_model

from slime_like.errors import WeightSyncError
from slime_like.weights.sharded import ShardedWeights
from slime_like.weights.sync import WeightSync

SCALE = 2.0  # a power of two: scaling is exact, the same bits on every rank


def shard(model):
    """FSDP2 over the group: one unit per decoder layer, then the root (as the trainer)."""
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def sharded_sync_rank(rank: int, world: int, port: int, engines: list, model_dir: str,
                      seed: int, settings: dict, die_after: int, out, ack=None) -> None:
    """One rank: rank 0 syncs the engines from the shards, the others serve its gathers.

    Without `die_after`: one sync per transport of `settings["transports"]`, the weights
    scaled after each once the test acknowledged it (`ack`). `die_after` > 0: rank 1 exits (os._exit, a real process death) after sending that many
    buckets; the only way to lose a rank at a chosen point of the gather.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model = shard(trainer_model(model_dir, seed))
    source = ShardedWeights(model, bucket_bytes=settings["sync"]["update_weight_buffer_size"])
    if rank != 0:
        if not die_after:
            for _ in settings["transports"]:
                out.put(("served", rank, source.serve()))
                scale_shards(model)
            dist.destroy_process_group()
            return
        if rank == 1:
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
    if die_after:
        sync = WeightSync(engines, **settings["sync"])
        try:
            sync.update(source, f"sharded-{seed}")
            out.put(("ok", None, source.stats.as_dict()))
        except WeightSyncError as e:
            out.put(("failed", e.step, str(e), source.stats.as_dict()))
        finally:
            source.finish()
            sync.close()
        return
    for k, transport in enumerate(settings["transports"]):
        sync = WeightSync(engines, **{**settings["sync"], "transport": transport})
        source = ShardedWeights(model, bucket_bytes=settings["sync"]["update_weight_buffer_size"],
                                copies=transport != "distributed")  # as the trainer sets it
        try:
            report = sync.update(source, f"sharded-{seed}-{k}")
            out.put(("ok", report.as_dict(), source.stats.as_dict()))
        finally:
            source.finish()
            sync.close()
        ack.get(timeout=240)  # the test has checked the engines: change the weights now
        scale_shards(model)
    dist.destroy_process_group()


@torch.no_grad()
def scale_shards(model) -> None:
    """New weights between syncs, the same on every rank and in the test's reference."""
    for p in model.parameters():
        p.to_local().mul_(SCALE)
