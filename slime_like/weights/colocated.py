"""The `tensor` transport: colocated engines read the trainer's buckets in place.

Each bucket is packed into one of two rotating flat buffers (CUDA memory on GPU, named
shared memory on CPU) and posted as `update_weights_from_tensor` with `flattened_bucket`:
one payload per TP rank, each a handle to the same buffer, so no tensor bytes cross HTTP.
A buffer is reused only after every engine answered the bucket that used it (the engine
has copied out of it by then); meanwhile the next bucket is packed into the other one.
"""

from __future__ import annotations

import time

import torch

from slime_like.engine import protocol as p
from slime_like.weights.buckets import layout
from slime_like.weights.serialization import serialize
from slime_like.weights.transfer import (
    BucketPacker,
    EngineCall,
    bucket_tensors,
    direct_view,
    timed,
)
from slime_like.weights.transport import TransferContext, Transport


class TensorTransport(Transport):
    """CUDA IPC handles on GPU, shared-memory tensors on CPU; engines on the same host."""

    name = "tensor"

    def __init__(self, *, device: torch.device | str = "cpu", bucket_bytes: int):
        self.device = torch.device(device)
        self.packer = BucketPacker(self.device, bucket_bytes, cpu_share=True)

    def transfer(self, ctx: TransferContext) -> None:
        packer, watch, stats = self.packer, ctx.watch, ctx.stats
        cuda = packer.stream is not None
        packer.begin()
        src = iter(ctx.source.tensors())
        slot_calls: list[list[EngineCall]] = [[] for _ in range(packer.slots)]
        all_calls: list[EngineCall] = []
        keep = []
        n = len(ctx.buckets)
        for k, bucket in enumerate(ctx.buckets):
            tensors = bucket_tensors(src, bucket)
            slot = k % packer.slots
            # A lone CUDA tensor is shared straight from its own storage (no pack); on CPU
            # parameters are not in shared memory, so everything goes through the buffers.
            buf = direct_view(tensors, self.device) if cuda else None
            packed = buf is None
            if packed:
                t0 = time.perf_counter()
                watch.wait_calls(slot_calls[slot])  # engines are done reading this buffer
                stats.wait_s += time.perf_counter() - t0
                buf = packer.pack(slot, tensors, bucket.nbytes)
                if cuda:
                    packer.stream.synchronize()  # the engine reads it from another process
            else:
                keep.append(buf)
            obj = {"flattened_tensor": buf, "metadata": layout(bucket.metas)}
            step = f"update_weights_from_tensor (bucket {k + 1}/{n})"
            # Each bucket carries its own handles and layout, so buckets may reach an engine
            # in any order; only the last one (it sets weight_version) waits for the others.
            gate = _all_done(list(all_calls)) if k == n - 1 else _always
            calls = []
            for engine in ctx.engines:
                req = p.UpdateWeightsFromTensorRequest(
                    serialized_named_tensors=[serialize(obj) for _ in range(engine.tp_size)],
                    load_format="flattened_bucket", flush_cache=False,
                    weight_version=ctx.weight_version if k == n - 1 else None)
                calls.append(watch.add(EngineCall(engine, step, ctx.calls.submit(
                    engine, timed(engine.client.update_weights_from_tensor, stats, engine.url),
                    req, ctx.http_timeout_s, gate=gate))))
            if packed:
                slot_calls[slot] = calls
            all_calls += calls
            stats.bytes += bucket.nbytes
            stats.buckets += 1
        t0 = time.perf_counter()
        watch.wait_calls(all_calls)
        stats.wait_s += time.perf_counter() - t0
        packer.finish()
        stats.pack_s += packer.pack_seconds()
        if cuda:
            torch.cuda.ipc_collect()  # let torch free IPC blocks engines have released

    def close(self, engines) -> None:
        self.packer.release()


def _always() -> bool:
    return True


def _all_done(calls: list[EngineCall]):
    return lambda: all(c.future.done() for c in calls)
