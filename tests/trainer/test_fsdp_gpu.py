"""--train-backend fsdp on GPUs (NCCL): shards offload and come back, and the sync's gather
on CUDA buffers yields every full tensor exactly.

Needs CUDA (skipped on CPU machines such as CI); uses min(2, GPUs) ranks. Run on a GPU
host with `python -m pytest tests/trainer/test_fsdp_gpu.py`.
"""

from __future__ import annotations

import io
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_like.cluster.ports import free_port
from slime_like.models.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SAMPLES = [([1, 2, 3, 4], [5, 6, 7]), ([8, 9], [10, 11, 12, 13])]


def _local_on(policy, device: str) -> bool:
    tensors = [p.to_local() for p in policy.model.parameters()]
    tensors += [v.to_local() for s in policy.optimizer.state.values() for v in s.values()
                if hasattr(v, "to_local")]
    return bool(tensors) and all(t.device.type == device for t in tensors)


def gpu_rank(rank: int, world: int, port: int, model_dir: str, out) -> None:
    from slime_like.protocol.buckets import plan_buckets
    from slime_like.trainer.policy import PolicyTrainer
    from slime_like.weights.sharded import ShardedWeights

    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(minutes=2),
                            device_id=torch.device("cuda", rank))
    policy = PolicyTrainer(model_dir, device=f"cuda:{rank}", seed=0, group=dist.group.WORLD,
                           backend="fsdp", lr=1e-2)
    policy.train_step(SAMPLES[rank::world] or SAMPLES, [1.0, -1.0][rank::world] or [1.0])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    policy.move_to("cpu")  # --offload-train
    freed = before - torch.cuda.memory_allocated()
    on_cpu = _local_on(policy, "cpu")
    policy.move_to(f"cuda:{rank}")
    back = _local_on(policy, "cuda")
    metrics = policy.train_step(SAMPLES[rank::world] or SAMPLES, [1.0, -1.0][rank::world] or [1.0])
    full = {n: p.full_tensor().cpu() for n, p in policy.model.named_parameters()}
    group = dist.new_group(backend="nccl")
    source = ShardedWeights(policy.model, bucket_bytes=64 << 10, group=group,
                            dtype=torch.bfloat16)
    result = {"freed": freed, "on_cpu": on_cpu, "back": back, "loss": metrics["loss"]}
    if rank == 0:
        got = {}
        stream = source.tensors()
        # A consumer that sends each bucket at once (as the transport: pull, then report).
        for k, bucket in enumerate(plan_buckets(source.metadata(), 64 << 10)):
            for _ in bucket.metas:
                name, t = next(stream)
                got[name] = t.cpu().clone()
            source.bucket_sent(k, ())
        source.finish()
        result["exact"] = all(torch.equal(got[n], full[n].to(torch.bfloat16)) for n in full
                              if n in got)
        result["names"] = sorted(got) == sorted(n for n in full if n in got) and len(got) > 0
        result["buckets"] = source.stats.buckets
    else:
        result["served"] = source.serve()
    buf = io.BytesIO()
    torch.save(result, buf)
    out.put((rank, buf.getvalue()))
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_shards_offload_and_gather_on_cuda(tmp_path):
    world = min(2, torch.cuda.device_count())
    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=gpu_rank, args=(r, world, port, str(model_dir), out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=300) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    results = {r: torch.load(io.BytesIO(b), weights_only=False) for r, b in results.items()}
    for r in results.values():
        assert r["on_cpu"] and r["back"] and r["freed"] > 0, r
    assert results[0]["exact"] and results[0]["names"] and results[0]["buckets"] > 2, results[0]
    for rank in range(1, world):
        assert results[rank]["served"] == results[0]["buckets"]
