"""The `tensor` transport: colocated engines read the trainer's buckets in place.

Each bucket is packed into a flat buffer and posted as `update_weights_from_tensor` with
`flattened_bucket`: one payload per TP rank, each a handle to the same buffer (CUDA IPC on
GPU, named shared memory on CPU), so no tensor bytes cross HTTP. Bucket k+1 is packed while
the engines load bucket k; at most two buckets are in flight. Buckets that already lie back
to back in the trainer's storage (flat parameter buffers) are not packed, and consecutive
ones go as one request: no buffer bounds them, so splitting them would only add round trips.

Separate parameters that stay where they are go in place from their second sync on, one
request of (name, tensor) handles that each engine keeps mapped (`shared_params.py`), to
engines that advertise it; the rest of this docstring is the packed and flat paths.

Two buffers rotate, across buckets and across syncs, so an engine maps each CUDA IPC
handle (or shared-memory segment) once, not once per bucket or per sync: each request says
whether the engine may keep its buffer mapped past `end_weight_update`
(`keep_ipc_mapping`, a field sglang's schema ignores; sglang closes each mapping right
after its load anyway), and the reference engine keeps it until the end of the first
session that does not ask again (`reference_engine/ipc_mappings.py`). The trainer decides,
because only it knows what it will free:

- its pack buffers: kept, except in the sync before they are renewed (every
  `renew_every` syncs), so the engines have let go of them when they are dropped;
- a storage of its own sent in place: kept only from its second sync on (the last sync sent
  the same storage object) and while the source says it stays until the next sync
  (`storage_stays()`, optional; the trainer's is `TrainerOffload.weights_stay`). An
  offloading trainer's flat buffer is new every sync and freed at the next offload, so it
  is never kept and is freed for real; weights kept on the GPU
  (`--no-offload-train-weights`) stay mapped from sync to sync, but not across the offload
  that renews their buffer.

A buffer that moved without notice (another storage sent instead) is let go of at the end
of that sync; `close()` runs an empty update session on every engine so nothing stays
mapped after it. On CPU a storage already in shared memory goes in place too (any other is
packed: sharing it would move the trainer's tensors), under the same rule.

A buffer is rewritten only after the engines answered the bucket it held: the reference
engine finishes its copy before answering, and sglang frees the received storage before it
answers, which synchronizes its stream (torch's IPC deleter does).

Last sync's requests are kept while the trainer's weights stay where they were
(`DirectRequests`, below). A trainer whose weights live in one flat buffer (`--no-offload-train-weights`, or
Megatron-style flat parameters) sends them in place: each request is a view of that buffer.
Working the requests out again walks every tensor in Python (storage, address, contiguity,
bucket joins) and hashes every tensor's metadata, about 1-3 ms for a few hundred tensors,
all of it on the sync's critical path before the first update goes out. While every
parameter still has the address it had and the storage is the same object (not a new
buffer that got the old address back), the requests are the same, so they are rebuilt
from a few numbers per request instead.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from slime_like.engine.session import EngineSession
from slime_like.protocol import io_struct as p
from slime_like.protocol.buckets import Bucket, TensorMeta, layout
from slime_like.protocol.ready_event import READY_EVENT_KEY, ReadyEvent
from slime_like.protocol.tensor_payload import FlattenedPayloads
from slime_like.weights.packing import (
    BucketPacker,
    SendGroup,
    WeightSource,
    in_shared_memory,
    send_groups,
    storage_slice,
)
from slime_like.weights.shared_params import SharedParams
from slime_like.weights.transport import Payload, TransferStats, Transport
from slime_like.weights.watch import Watch

RENEW_EVERY = 64  # syncs between fresh pack buffers (bounds torch's per-share wrapping)


class TensorTransport(Transport):
    """CUDA IPC handles on GPU, shared-memory tensors on CPU; engines on the same host."""

    name = "tensor"

    def __init__(self, *, device: torch.device | str = "cpu", bucket_bytes: int,
                 renew_every: int = RENEW_EVERY, ready_event: bool = True):
        """`ready_event`: on CUDA, engines that advertise it wait for the trainer's writes
        on their GPU stream instead of the trainer waiting on its host before each request
        (`protocol/ready_event.py`); off, the trainer always synchronizes."""
        self.device = torch.device(device)
        self.ready_event = ready_event
        self._ready = ReadyEvent(self.device) if self.device.type == "cuda" else None
        self.packer = BucketPacker(self.device, bucket_bytes, cpu_share=True)
        self.renew_every = renew_every
        self._syncs = 0
        # The same requests come back every sync: their metadata is laid out and pickled once.
        self.serialized = FlattenedPayloads()
        self.direct = DirectRequests()
        self.kept = KeptStorages()
        self.shared = SharedParams()  # separate parameters sent in place, shared once
        self._asked_keep = False  # an engine may keep a mapping of ours (closed at close())

    def payloads(self, engines: Sequence[EngineSession], source: WeightSource,
                 buckets: Sequence[Bucket], version: str, watch: Watch, stats: TransferStats
                 ) -> Iterator[Payload]:
        packer = self.packer
        cuda = packer.stream is not None
        keep_packs = self._renew_buffers()
        packer.begin()
        slots: list[Payload | None] = [None] * packer.slots
        posted: list[Payload] = []
        stays = _storage_stays(source)
        self.kept.begin()
        groups = self.direct.reuse(source, buckets, self.device)
        if groups is None:
            resident = _resident(source)
            if self.shared.usable(engines, resident, self.device, stays):
                yield from self._shared_payload(engines, source, resident, stats)
                packer.finish()
                return
        if groups is None:  # else: the same storages at the same places, last sync's requests
            groups = self.direct.record(source, buckets, self.device, send_groups(
                iter(source.tensors()), buckets, self.device, merge_direct=True,
                allow_direct=None if cuda else in_shared_memory))
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
            ready = None
            if buf is not None:
                # Already back to back in the trainer's storage: the engines copy from it.
                ready = self._writes_done(engines)
                # Kept open past the session only if the last sync sent this same storage
                # and the source says it stays until the next one.
                keep = self.kept.sent(buf.untyped_storage()) and stays
            else:
                buf = packer.pack(slot, group.pack_sources(), group.nbytes)
                if cuda:
                    packer.wait_packed()  # the engine reads it from another process, off our streams
                keep = keep_packs
            # Each request carries its own handles and layout, so requests may reach an
            # engine in any order; only the last one (it sets weight_version) waits for the
            # others.
            payload = Payload(
                f"update_weights_from_tensor (request {k + 1}, {len(group.metas)} tensors)",
                "update_weights_from_tensor", self._request(buf, group, keep, ready),
                group.nbytes, last,
                after=list(posted) if last else [])
            yield payload
            slots[slot] = payload
            posted.append(payload)
            del buf
            stats.bytes += group.nbytes
            stats.buckets += 1
        stats.prep_s += time.perf_counter() - t_prep
        packer.finish()
        stats.pack_s += packer.pack_seconds()

    def _shared_payload(self, engines: Sequence[EngineSession], source: WeightSource,
                        tensors: list[torch.Tensor], stats: TransferStats
                        ) -> Iterator[Payload]:
        """The one request of a sync that sends every parameter in place."""
        t0 = time.perf_counter()
        metas = source.metadata()
        ready = self._writes_done(engines)  # the engines read them from another process
        nbytes = sum(m.nbytes for m in metas)
        payload = Payload(f"update_weights_from_tensor (every parameter in place, {len(metas)} "
                          "tensors)", "update_weights_from_tensor",
                          self.shared.request(metas, tensors, ready), nbytes, True, after=[])
        stats.prep_s += time.perf_counter() - t0
        yield payload  # the sync builds every engine's request before it resumes us
        self.shared.landed()
        self._asked_keep = True
        stats.bytes += nbytes
        stats.buckets += 1

    def failed(self) -> None:
        self.shared.failed()

    def forget(self, urls: Sequence[str]) -> None:
        self.shared.forget(urls)

    def _writes_done(self, engines: Sequence[EngineSession]) -> str | None:
        """Before a request the engines read from the trainer's own tensors (on CUDA): the
        handle of a ready event recorded after the trainer's writes when every engine
        waits for it on its GPU, else a host wait until those writes are done (None)."""
        if self._ready is None:
            return None
        if self.ready_event and all(e.server_info.get(READY_EVENT_KEY) for e in engines):
            return self._ready.record()
        torch.cuda.current_stream(self.device).synchronize()
        return None

    def _request(self, buf: torch.Tensor, group: SendGroup, keep: bool,
                 ready: str | None = None):
        """The request builder of one flat buffer: one handle per TP rank, the layout
        pickled once per bucket signature (the same requests come back every sync);
        `keep`: the engines may keep the buffer mapped until the next sync; `ready`: the
        event the engines wait for before they copy (`_writes_done`)."""
        key, metas = group.signature or tuple(group.metas), group.metas

        def request(engine: EngineSession, flush: bool, version: str | None):
            return p.UpdateWeightsFromTensorRequest(
                serialized_named_tensors=[
                    self.serialized.serialize(buf, key, lambda: layout(metas))
                    for _ in range(engine.tp_size)],
                load_format=p.FLATTENED_BUCKET, flush_cache=flush, weight_version=version,
                keep_ipc_mapping=keep, ready_event=ready)
        self._asked_keep = self._asked_keep or keep
        return request

    @staticmethod
    def _release_mappings(engines: Sequence[EngineSession]) -> None:
        """An empty update session on every engine: it closes whatever the engine kept
        mapped for us (a session that does not send a kept buffer again lets go of it),
        so buffers we free after closing are freed for real. Best effort: an engine that
        is gone or busy has nothing of ours to keep, or lets go at its next session."""
        for engine in engines:
            try:
                engine.http.begin_weight_update(timeout=5.0)
                engine.http.end_weight_update(timeout=5.0)
            except Exception:  # noqa: BLE001 - teardown: a failure here changes nothing
                continue

    def _renew_buffers(self) -> bool:
        """New pack buffers every `renew_every` syncs; whether this sync's pack buffers
        are still the same at the next sync (so the engines may keep them mapped).

        torch wraps a CUDA storage in one more reference-counting layer (an interprocess
        event and a counter slot) every time it is shared, released only with the storage;
        fresh buffers now and then keep that chain short. The sync before a renewal does
        not ask the engines to keep the old buffers, so they closed them at its
        end_weight_update, and torch frees them here (ipc_collect gives back every block
        the engines let go of).
        """
        if self.packer.is_cuda:
            torch.cuda.ipc_collect()
        self._syncs += 1
        if self._syncs % self.renew_every == 0:
            self.packer.release()
        return (self._syncs + 1) % self.renew_every != 0

    def prepare(self, buckets) -> None:
        # On GPU a one-tensor bucket goes straight from the trainer's memory; on CPU every
        # bucket is packed into named shared memory.
        packed = [b.nbytes for b in buckets if len(b.metas) > 1 or not self.packer.is_cuda]
        if packed:
            self.packer.reserve(max(packed), len(packed))

    def close(self, engines) -> None:
        if self._asked_keep:
            self._release_mappings(engines)
        self.direct.clear()
        self.kept.clear()
        self.shared.clear()
        self.packer.release()
        if self.packer.is_cuda:
            torch.cuda.ipc_collect()  # give back buffers every engine has let go of


class KeptStorages:
    """The storages the last sync sent in place, by identity (a weak reference each).

    A trainer buffer sent in place is kept mapped by the engines only from its second sync
    on: the first time, nothing says it outlives the sync (an offloading trainer's flat
    buffer is new every sync and freed at the next offload, and must not stay mapped).
    """

    def __init__(self) -> None:
        self._last: list[StorageWeakRef] = []
        self._now: list[StorageWeakRef] = []

    def begin(self) -> None:
        self._last, self._now = self._now, []

    def sent(self, storage: torch.UntypedStorage) -> bool:
        """Record `storage` as sent in place by this sync; True if the last sync sent it."""
        ref = StorageWeakRef(storage)
        self._now.append(ref)
        return any(not r.expired() and r.cdata == ref.cdata for r in self._last)

    def clear(self) -> None:
        self._last, self._now = [], []


def _storage_stays(source: object) -> bool:
    """The source's word that its storages outlive the next sync (True without one)."""
    stays = getattr(source, "storage_stays", None)
    return True if stays is None else bool(stays())


@dataclass(eq=False)
class _Request:
    """One in-place request: where its bytes are, and its metadata (hashed by identity)."""

    first: int  # the source index of its first tensor (whose storage holds the bytes)
    offset: int  # byte offset in that storage
    nbytes: int
    metas: list[TensorMeta]
    buckets: int
    storage: StorageWeakRef


class DirectRequests:
    """The requests of the last sync that sent everything in place, for one source."""

    def __init__(self) -> None:
        # the source by weak reference: a source the caller dropped (and the buffers its
        # tensors view) is not kept alive here
        self._source: Callable[[], object | None] | None = None
        self._buckets: Sequence[Bucket] | None = None
        self._addresses: tuple[int, ...] | None = None
        self._requests: list[_Request] = []
        # name -> source index, per metadata list (an offloading trainer misses every sync)
        self._index: tuple[list[TensorMeta], dict[str, int]] | None = None

    def clear(self) -> None:
        self._source = self._buckets = self._addresses = None
        self._requests = []

    def reuse(self, source: object, buckets: Sequence[Bucket], device: torch.device,
              ) -> list[tuple[SendGroup, bool]] | None:
        """Last sync's requests, or None when anything about the weights moved."""
        if self._source is None or source is not self._source() or buckets is not self._buckets:
            return None
        tensors = _resident(source)
        if tensors is None or tuple(t.data_ptr() for t in tensors) != self._addresses:
            return None
        out = []
        for r in self._requests:
            storage = tensors[r.first].untyped_storage()
            if r.storage.expired() or r.storage.cdata != storage._cdata:
                return None  # a new buffer at the old address: a new CUDA IPC handle
            view = storage_slice(storage, r.offset, r.offset + r.nbytes, device)
            out.append(SendGroup(r.metas, [], r.nbytes, view, buckets=r.buckets, signature=r))
        return [(g, k == len(out) - 1) for k, g in enumerate(out)]

    def record(self, source: object, buckets: Sequence[Bucket], device: torch.device,
               groups: Iterator[tuple[SendGroup, bool]]) -> Iterator[tuple[SendGroup, bool]]:
        """Pass `groups` through; keep them if every one went in place."""
        self.clear()
        tensors = _resident(source)
        index = self._name_index(source.metadata()) if tensors is not None else None
        requests: list[_Request] | None = [] if tensors is not None else None
        for group, last in groups:
            if requests is not None:
                if group.view is None:
                    requests = None  # packed: the pack needs the tensors every sync
                else:
                    storage = group.view.untyped_storage()
                    requests.append(_Request(
                        index[group.metas[0].name], group.view.data_ptr() - storage.data_ptr(),
                        group.nbytes, list(group.metas), group.buckets, StorageWeakRef(storage)))
            yield group, last
        if requests:
            self._source, self._buckets, self._requests = _ref(source), buckets, requests
            self._addresses = tuple(t.data_ptr() for t in tensors)

    def _name_index(self, metas: list[TensorMeta]) -> dict[str, int]:
        if self._index is None or self._index[0] is not metas:
            self._index = (metas, {m.name: i for i, m in enumerate(metas)})
        return self._index[1]


def _ref(obj: object) -> Callable[[], object | None]:
    try:
        return weakref.ref(obj)
    except TypeError:  # not weakly referenceable: held
        return lambda: obj


def _resident(source: object) -> list[torch.Tensor] | None:
    resident = getattr(source, "resident", None)
    return resident() if resident is not None else None
