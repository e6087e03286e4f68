"""Last sync's in-place requests are reused only while the weights stay where they were."""

from __future__ import annotations

import torch
from torch import nn

from slime_like.protocol.buckets import plan_buckets
from slime_like.weights.packing import ModelWeights, send_groups
from slime_like.weights.tensor import DirectRequests

CPU = torch.device("cpu")


class _Flat(nn.Module):
    """Three parameters that are views of one flat buffer (a flat-parameter trainer)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 8))
        self.b = nn.Parameter(torch.randn(16))
        self.c = nn.Parameter(torch.randn(2, 8))
        self.rehome()

    def rehome(self) -> torch.Tensor:
        """Move the parameters into a new flat buffer (what an onload does)."""
        params = list(self.parameters())
        flat = torch.empty(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            flat[offset:offset + p.numel()] = p.detach().reshape(-1)
            p.data = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self.flat = flat
        return flat


def _first_sync(source, buckets, cache):
    return list(cache.record(source, buckets, CPU, send_groups(
        iter(source.tensors()), buckets, CPU, merge_direct=True)))


def test_requests_are_rebuilt_from_the_cache_while_the_buffer_stays():
    model = _Flat()
    source = ModelWeights(model)
    buckets = plan_buckets(source.metadata(), 96)  # several buckets, joined into one request
    cache = DirectRequests()
    first = _first_sync(source, buckets, cache)
    assert len(first) == 1 and first[0][1]
    again = cache.reuse(source, buckets, CPU)
    assert again is not None and len(again) == 1
    group, last = again[0]
    assert last and group.nbytes == first[0][0].nbytes and group.metas == first[0][0].metas
    assert group.view.data_ptr() == model.flat.data_ptr()
    assert torch.equal(group.view, first[0][0].view)
    assert group.signature is cache.reuse(source, buckets, CPU)[0][0].signature  # one pickle
    with torch.no_grad():  # a train step writes in place: the cached view sees the new bytes
        model.b.add_(1.0)
    assert torch.equal(cache.reuse(source, buckets, CPU)[0][0].view, model.flat.view(torch.uint8))


def test_a_new_buffer_another_source_or_other_buckets_are_not_served_from_the_cache():
    model = _Flat()
    source = ModelWeights(model)
    buckets = plan_buckets(source.metadata(), 96)
    cache = DirectRequests()
    _first_sync(source, buckets, cache)
    assert cache.reuse(ModelWeights(model), buckets, CPU) is None   # another source object
    assert cache.reuse(source, list(buckets), CPU) is None          # a re-planned bucket list
    old = model.flat
    model.rehome()                                                   # the weights moved
    assert model.flat.data_ptr() != old.data_ptr()
    assert cache.reuse(source, buckets, CPU) is None


def test_a_source_that_needs_a_pack_is_not_cached():
    model = _Flat()
    model.b.data = model.b.detach().clone()  # b leaves the flat buffer: its bucket is packed
    source = ModelWeights(model)
    buckets = plan_buckets(source.metadata(), 1 << 20)
    cache = DirectRequests()
    groups = _first_sync(source, buckets, cache)
    assert groups[0][0].view is None
    assert cache.reuse(source, buckets, CPU) is None


def test_a_new_storage_at_the_old_address_is_not_taken_for_the_one_last_sync_sent():
    """An offloading trainer frees its flat buffer and often gets the same address back: a
    new storage there is a new CUDA IPC handle, so the requests are worked out again."""
    memory = bytearray(4 * 64)  # the three parameters, 64 floats
    model = _Flat()
    source = ModelWeights(model)

    def home(flat: torch.Tensor) -> None:
        offset = 0
        for p in model.parameters():
            p.data = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

    home(torch.frombuffer(memory, dtype=torch.float32))
    buckets = plan_buckets(source.metadata(), 1 << 20)
    cache = DirectRequests()
    _first_sync(source, buckets, cache)
    assert cache.reuse(source, buckets, CPU) is not None
    again = torch.frombuffer(memory, dtype=torch.float32)  # another storage, same address
    home(again)
    assert model.a.data_ptr() == again.data_ptr()
    assert cache.reuse(source, buckets, CPU) is None
