"""Last sync's requests, kept while the trainer's weights stay where they were.

A trainer whose weights live in one flat buffer (`--no-offload-train-weights`, or
Megatron-style flat parameters) sends them in place: each request is a view of that buffer.
Working the requests out again walks every tensor in Python (storage, address, contiguity,
bucket joins) and hashes every tensor's metadata, about 1-3 ms for a few hundred tensors,
all of it on the sync's critical path before the first update goes out. While every
parameter still has the address it had and the storage is the same object (not a new
buffer that got the old address back), the requests are the same, so they are rebuilt
from a few numbers per request instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from slime_like.protocol.buckets import Bucket, TensorMeta
from slime_like.weights.packing import SendGroup, storage_slice


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
        self._source: object | None = None
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
        if source is not self._source or buckets is not self._buckets:
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
            self._source, self._buckets, self._requests = source, buckets, requests
            self._addresses = tuple(t.data_ptr() for t in tensors)

    def _name_index(self, metas: list[TensorMeta]) -> dict[str, int]:
        if self._index is None or self._index[0] is not metas:
            self._index = (metas, {m.name: i for i, m in enumerate(metas)})
        return self._index[1]


def _resident(source: object) -> list[torch.Tensor] | None:
    resident = getattr(source, "resident", None)
    return resident() if resident is not None else None
