"""Separate trainer parameters sent in place: each shared once, the engines keep them mapped.

A trainer whose parameters are separate tensors (not one flat buffer) had every byte copied
twice on its GPU at each `tensor` sync: packed into a rotating buffer, then copied by the
engine out of it, with a pack, a wait and a request per bucket. Sharing each parameter
itself instead (a CUDA IPC handle per storage) costs torch an interprocess event and a
reference-count slot per storage on the trainer and an open per storage on the engine,
more than the pack for a model of a few hundred tensors (`benchmarks/ipc_sharing.py`).
That cost is per share, not per sync: once an engine holds the handles mapped, the same
parameters need no new share while they stay where they are.

So, from the second sync that sees the same parameter storages (the first one packs, as
before: nothing yet says they outlive a sync), every parameter goes in place as one
`update_weights_from_tensor` request of (name, tensor) handles, sglang's plain payload,
with `keep_ipc_mapping`. Each engine gets its own share, made once and kept with its
serialized bytes while the engine holds it (same URL, same process: `delta.identity`); the
later syncs send those same bytes again, which an engine advertising
`protocol.tensor_payload.KEPT_PAYLOADS_KEY` recognizes, copying straight from the mapped
parameters without unpickling or opening anything (`reference_engine/ipc_mappings.py`).
Reused bytes never reach an engine that might not hold them: a failed sync, an engine
that left or restarted, a moved parameter (new storage or address) or a source that says
its storages will not stay (an offload is coming) makes fresh shares, or packs.

Only engines that advertise the key get this path (real sglang rebuilds every payload and
closes it after the load: re-sharing a few hundred storages every sync would cost it more
than the pack), only on CUDA or from CPU shared memory, and only when every tensor the
source sends is a resident tensor of its own (no cast, quantization or LoRA merge).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from slime_like.engine.session import EngineSession
from slime_like.protocol import io_struct as p
from slime_like.protocol.buckets import TensorMeta
from slime_like.protocol.tensor_payload import KEPT_PAYLOADS_KEY, serialize
from slime_like.weights.delta import identity


class SharedParams:
    """Which parameter storages the engines hold mapped, and each engine's share of them."""

    def __init__(self) -> None:
        self._addresses: tuple[int, ...] | None = None
        self._storages: list[StorageWeakRef] = []
        self._seen = False  # the last sync saw these same storages (packed or in place)
        # url -> (the engine's identity, one serialized payload per TP rank)
        self._shares: dict[str, tuple[tuple, list[str]]] = {}
        self._sent: dict[str, tuple[tuple, list[str]]] = {}

    def usable(self, engines: Sequence[EngineSession], tensors: list[torch.Tensor] | None,
               device: torch.device, stays: bool) -> bool:
        """Whether this sync sends every parameter in place (see the module docstring).
        Records the storages either way, so the next sync knows whether they moved."""
        same = tensors is not None and self._same(tensors)
        seen, self._seen = self._seen and same, False
        if tensors is None or not tensors or not stays:
            self._record(None)
            return False
        if not same:  # checked once per storage set: a set seen again passed them
            if _one_storage(tensors) or not all(_in_place(t, device) for t in tensors):
                # one flat buffer goes in place as views of it (tensor.DirectRequests)
                self._record(None)
                return False
            self._record(tensors)
        self._seen = True
        return seen and all(e.server_info.get(KEPT_PAYLOADS_KEY) for e in engines)

    def _same(self, tensors: list[torch.Tensor]) -> bool:
        if self._addresses is None or len(tensors) != len(self._storages):
            return False
        if tuple(t.data_ptr() for t in tensors) != self._addresses:
            return False
        return all(not r.expired() and r.cdata == t.untyped_storage()._cdata
                   for r, t in zip(self._storages, tensors, strict=True))

    def _record(self, tensors: list[torch.Tensor] | None) -> None:
        if tensors is None:
            self._addresses, self._storages = None, []
            self._shares.clear()  # moved or not shareable: no engine may reuse a share
            return
        self._addresses = tuple(t.data_ptr() for t in tensors)
        self._storages = [StorageWeakRef(t.untyped_storage()) for t in tensors]
        self._shares.clear()

    def request(self, metas: Sequence[TensorMeta], tensors: list[torch.Tensor],
                ready: str | None = None):
        """The request builder of the one in-place request: an engine that holds its share
        gets the same bytes again, any other a fresh share (kept for the next sync);
        `ready`: the trainer's ready event (`protocol/ready_event.py`), or None."""
        named = [(m.name, t) for m, t in zip(metas, tensors, strict=True)]
        self._sent = {}

        def build(engine: EngineSession, flush: bool, version: str | None):
            who = identity(engine)
            held = self._shares.get(engine.url)
            payloads = held[1] if held is not None and held[0] == who else [
                serialize(named) for _ in range(engine.tp_size)]
            self._sent[engine.url] = (who, payloads)
            return p.UpdateWeightsFromTensorRequest(
                serialized_named_tensors=payloads, load_format=None, flush_cache=flush,
                weight_version=version, keep_ipc_mapping=True, ready_event=ready)
        return build

    def landed(self) -> None:
        """Every byte of the sync is on its way: the engines it went to hold their shares
        (until a failure says otherwise)."""
        self._shares, self._sent = self._sent, {}

    def failed(self) -> None:
        """A failed sync: no engine is known to hold a share; the next makes fresh ones."""
        self._shares.clear()
        self._sent = {}

    def forget(self, urls: Sequence[str]) -> None:
        for url in urls:
            self._shares.pop(url, None)

    def clear(self) -> None:
        self._record(None)
        self._seen = False
        self._sent = {}


def _one_storage(tensors: list[torch.Tensor]) -> bool:
    first = tensors[0].untyped_storage()._cdata
    return all(t.untyped_storage()._cdata == first for t in tensors)


def _in_place(t: torch.Tensor, device: torch.device) -> bool:
    """A tensor an engine may map: on the sync's GPU, or in CPU shared memory (sharing
    any other CPU storage would move the trainer's tensor into shared memory)."""
    if device.type == "cuda":
        return t.is_cuda and (device.index is None or t.device.index == device.index)
    return t.device.type == "cpu" and t.untyped_storage().is_shared()
