"""The `tensor` transport: colocated engines read the trainer's buckets in place.

Each bucket is packed into a flat buffer and posted as `update_weights_from_tensor` with
`flattened_bucket`: one payload per TP rank, each a handle to the same buffer (CUDA IPC on
GPU, named shared memory on CPU), so no tensor bytes cross HTTP. Bucket k+1 is packed while
the engines load bucket k; at most two buckets are in flight. Buckets that already lie back
to back in the trainer's storage (flat parameter buffers) are not packed, and consecutive
ones go as one request: no buffer bounds them, so splitting them would only add round trips.

Two buffers rotate, across buckets and across syncs, so an engine that keeps the storages
it opened for the rest of the update session (the reference engine does) maps each CUDA IPC
handle once per sync, not once per bucket. The trainer's own storage goes in place whether
or not it is the one the last sync sent: engines close every mapping when the update
session ends (sglang closes each right after its load), so a trainer that frees its flat
buffer between syncs (`--offload-train`) frees it for real, and its next buffer costs one
new mapping, well under a millisecond, instead of a pack copy of every byte.

A buffer is rewritten only after the engines answered the bucket it held: the reference
engine finishes its copy before answering, and sglang frees the received storage before it
answers, which synchronizes its stream (torch's IPC deleter does).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from slime_like.engine.session import EngineSession
from slime_like.protocol import io_struct as p
from slime_like.protocol.buckets import Bucket, layout
from slime_like.protocol.tensor_payload import FlattenedPayloads
from slime_like.weights.direct import DirectRequests
from slime_like.weights.packing import BucketPacker, SendGroup, WeightSource, send_groups
from slime_like.weights.transport import Payload, TransferStats, Transport, all_answered
from slime_like.weights.watch import Watch

RENEW_EVERY = 64  # syncs between fresh CUDA buffers (bounds torch's per-share wrapping)


class TensorTransport(Transport):
    """CUDA IPC handles on GPU, shared-memory tensors on CPU; engines on the same host."""

    name = "tensor"

    def __init__(self, *, device: torch.device | str = "cpu", bucket_bytes: int):
        self.device = torch.device(device)
        self.packer = BucketPacker(self.device, bucket_bytes, cpu_share=True)
        self._syncs = 0
        # The same requests come back every sync: their metadata is laid out and pickled once.
        self.serialized = FlattenedPayloads()
        self.direct = DirectRequests()

    def payloads(self, engines: Sequence[EngineSession], source: WeightSource,
                 buckets: Sequence[Bucket], version: str, watch: Watch, stats: TransferStats
                 ) -> Iterator[Payload]:
        packer = self.packer
        cuda = packer.stream is not None
        if cuda:
            self._renew_buffers()
        packer.begin()
        slots: list[Payload | None] = [None] * packer.slots
        posted: list[Payload] = []
        groups = self.direct.reuse(source, buckets, self.device) if cuda else None
        if groups is None:  # else: the same storages at the same places, last sync's requests
            groups = self.direct.record(source, buckets, self.device, send_groups(
                iter(source.tensors()), buckets, self.device, merge_direct=cuda))
        t_prep = time.perf_counter()
        for k, (group, last) in enumerate(groups):
            slot = k % packer.slots
            t0 = time.perf_counter()
            stats.prep_s += t0 - t_prep
            # At most two requests in flight: the engines answered the one before the last.
            before = slots[slot]
            if before is not None:
                watch.wait_calls(before.calls)
            t_prep = time.perf_counter()
            stats.wait_s += t_prep - t0
            # The slot's last bucket was answered, so the engines are done reading it (the
            # reference engine finishes its copy before answering; sglang drops the received
            # storage first, and torch synchronizes the stream when an IPC storage is freed).
            buf = group.view
            if buf is not None:
                # Already back to back in the trainer's storage: the engines copy from it.
                torch.cuda.current_stream(self.device).synchronize()
            else:
                buf = packer.pack(slot, group.pack_sources(), group.nbytes)
                if cuda:
                    packer.wait_packed()  # the engine reads it from another process, off our streams
            # Each request carries its own handles and layout, so requests may reach an
            # engine in any order; only the last one (it sets weight_version) waits for the
            # others.
            payload = Payload(
                f"update_weights_from_tensor (request {k + 1}, {len(group.metas)} tensors)",
                "update_weights_from_tensor", self._request(buf, group), group.nbytes, last,
                gate=all_answered(list(posted)) if last else _always)
            yield payload
            slots[slot] = payload
            posted.append(payload)
            del buf
            stats.bytes += group.nbytes
            stats.buckets += 1
        stats.prep_s += time.perf_counter() - t_prep
        packer.finish()
        stats.pack_s += packer.pack_seconds()

    def _request(self, buf: torch.Tensor, group: SendGroup):
        """The request builder of one flat buffer: one handle per TP rank, the layout
        pickled once per bucket signature (the same requests come back every sync)."""
        key, metas = group.signature or tuple(group.metas), group.metas

        def request(engine: EngineSession, flush: bool, version: str | None):
            return p.UpdateWeightsFromTensorRequest(
                serialized_named_tensors=[
                    self.serialized.serialize(buf, key, lambda: layout(metas))
                    for _ in range(engine.tp_size)],
                load_format=p.FLATTENED_BUCKET, flush_cache=flush, weight_version=version)
        return request

    def _renew_buffers(self) -> None:
        """New CUDA buffers every RENEW_EVERY syncs, and give back those engines let go of.

        torch wraps a storage in one more reference-counting layer (an interprocess event
        and a counter slot) every time it is shared, released only with the storage; fresh
        buffers now and then keep that chain short. The engines closed the old buffers at
        the last end_weight_update, so torch frees them here.
        """
        torch.cuda.ipc_collect()
        self._syncs += 1
        if self._syncs % RENEW_EVERY == 0:
            self.packer.release()

    def prepare(self, buckets) -> None:
        # On GPU a one-tensor bucket goes straight from the trainer's memory; on CPU every
        # bucket is packed into named shared memory.
        packed = [b.nbytes for b in buckets if len(b.metas) > 1 or not self.packer.is_cuda]
        if packed:
            self.packer.reserve(max(packed), len(packed))

    def close(self, engines) -> None:
        self.direct.clear()
        self.packer.release()
        if self.packer.is_cuda:
            torch.cuda.ipc_collect()  # give back buffers every engine has let go of


def _always() -> bool:
    return True
