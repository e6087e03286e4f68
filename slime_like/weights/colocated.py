"""The `tensor` transport: colocated engines read the trainer's buckets in place.

Each bucket is packed into a flat buffer and posted as `update_weights_from_tensor` with
`flattened_bucket`: one payload per TP rank, each a handle to the same buffer (CUDA IPC on
GPU, named shared memory on CPU), so no tensor bytes cross HTTP. Bucket k+1 is packed while
the engines load bucket k; at most two buckets are in flight.

On CPU two shared buffers rotate: a CPU engine has copied out when it answers. On GPU an
answer only proves the engine *queued* its copy (sglang does not synchronize), so every
bucket gets a fresh buffer from the caching allocator and is dropped after the answer;
torch keeps a dropped IPC block out of reuse until every consumer released it.
"""

from __future__ import annotations

import time

import torch

from slime_like.protocol import io_struct as p
from slime_like.protocol.buckets import layout
from slime_like.protocol.tensor_payload import serialize
from slime_like.weights.transfer import BucketPacker, EngineCall, bucket_tensors
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
        n = len(ctx.buckets)
        for k, bucket in enumerate(ctx.buckets):
            tensors = bucket_tensors(src, bucket)
            slot = k % packer.slots
            t0 = time.perf_counter()
            # At most two buckets in flight: the engines answered the one before the last.
            watch.wait_calls(slot_calls[slot])
            stats.wait_s += time.perf_counter() - t0
            if cuda:
                # Never a buffer the engine may still be copying from (see pack_fresh), and
                # never a parameter itself (the trainer would overwrite it next step).
                buf = packer.pack_fresh(tensors, bucket.nbytes)
            else:
                # A CPU engine's copy is done when it answers: the shared buffers rotate.
                buf = packer.pack(slot, tensors, bucket.nbytes)
            obj = {"flattened_tensor": buf, "metadata": layout(bucket.metas)}
            step = f"update_weights_from_tensor (bucket {k + 1}/{n})"
            # Each bucket carries its own handles and layout, so buckets may reach an engine
            # in any order; only the last one (it sets weight_version) waits for the others.
            gate = _all_done(list(all_calls)) if k == n - 1 else _always
            calls = []
            last = k == n - 1
            for engine in ctx.engines:
                req = p.UpdateWeightsFromTensorRequest(
                    serialized_named_tensors=[serialize(obj) for _ in range(engine.tp_size)],
                    load_format="flattened_bucket", flush_cache=ctx.flush_flag(engine, last),
                    weight_version=ctx.weight_version if last else None)
                call = ctx.update_call(engine.client.update_weights_from_tensor, engine, last)
                calls.append(watch.add(EngineCall(engine, step, ctx.calls.submit(
                    engine, call, req, ctx.http_timeout_s, gate=ctx.gate(engine, gate)))))
            slot_calls[slot] = calls
            all_calls += calls
            del obj, buf  # CUDA: the block sits in torch's IPC limbo until engines let go
            stats.bytes += bucket.nbytes
            stats.buckets += 1
        t0 = time.perf_counter()
        watch.wait_calls(all_calls)
        stats.wait_s += time.perf_counter() - t0
        packer.finish()
        stats.pack_s += packer.pack_seconds()
        if cuda:
            torch.cuda.ipc_collect()  # give back blocks every engine has released

    def close(self, engines) -> None:
        self.packer.release()


def _always() -> bool:
    return True


def _all_done(calls: list[EngineCall]):
    return lambda: all(c.future.done() for c in calls)
