"""Buckets already back to back in the trainer's memory go out without a pack."""

from __future__ import annotations

import torch

from slime_like.weights.packing import direct_view

CPU = torch.device("cpu")


def test_adjacent_views_of_one_buffer_are_sent_in_place():
    flat = torch.randn(100, dtype=torch.float32)
    a, b, c = flat[:10].view(2, 5), flat[10:40], flat[40:100].view(6, 10)
    view = direct_view([a, b, c], CPU)
    assert view is not None and view.numel() == 400
    assert view.data_ptr() == flat.data_ptr()
    assert torch.equal(view, flat.view(torch.uint8))
    offset = direct_view([b, c], CPU)
    assert offset.data_ptr() == b.data_ptr() and offset.numel() == 360


def test_gaps_other_order_or_separate_tensors_need_a_pack():
    flat = torch.randn(100)
    assert direct_view([flat[:10], flat[20:30]], CPU) is None      # a gap
    assert direct_view([flat[10:20], flat[:10]], CPU) is None      # other order
    assert direct_view([torch.randn(4), torch.randn(4)], CPU) is None
    assert direct_view([flat[:10].view(2, 5).t()], CPU) is None    # not contiguous
    one = torch.randn(3, 3)
    assert direct_view([one], CPU).data_ptr() == one.data_ptr()


def _named(tensors):
    return [(f"t{i}", t) for i, t in enumerate(tensors)]


def _buckets(named, max_bytes):
    from slime_like.protocol.buckets import TensorMeta, plan_buckets

    return plan_buckets([TensorMeta.of(n, t) for n, t in named], max_bytes)


def test_consecutive_direct_buckets_go_as_one_request_with_the_joined_layout():
    from slime_like.protocol.buckets import layout
    from slime_like.weights.packing import send_groups

    flat = torch.randn(1000)
    named = _named([flat[i * 100:(i + 1) * 100] for i in range(10)])
    buckets = _buckets(named, 800)  # two tensors (400 bytes each) per bucket: five buckets
    assert len(buckets) == 5
    groups = list(send_groups(iter(named), buckets, CPU, merge_direct=True))
    assert len(groups) == 1
    group, last = groups[0]
    assert last and group.buckets == 5 and group.nbytes == 4000
    assert group.view.data_ptr() == flat.data_ptr() and group.view.numel() == 4000
    entries = layout(group.metas)
    assert [e.name for e in entries] == [n for n, _ in named]
    got = group.view[entries[7].start_idx:entries[7].end_idx].view(torch.float32)
    assert torch.equal(got, named[7][1])


def test_separate_tensors_or_a_gap_keep_the_planned_buckets():
    from slime_like.weights.packing import send_groups

    flat = torch.randn(1000)
    # t0..t3 back to back, then a gap, then t4..t5: two direct groups.
    views = [flat[0:100], flat[100:200], flat[200:300], flat[300:400], flat[500:600], flat[600:700]]
    named = _named(views)
    groups = list(send_groups(iter(named), _buckets(named, 800), CPU, merge_direct=True))
    assert [(g.buckets, len(g.metas), last) for g, last in groups] == [(2, 4, False), (1, 2, True)]
    separate = _named([torch.randn(100) for _ in range(4)])
    groups = list(send_groups(iter(separate), _buckets(separate, 800), CPU, merge_direct=True))
    assert [(g.buckets, g.view is None) for g, _ in groups] == [(1, True), (1, True)]
    # Without merge_direct every bucket is its own request and is packed.
    groups = list(send_groups(iter(named), _buckets(named, 800), CPU, merge_direct=False))
    assert len(groups) == 3 and all(g.view is None for g, _ in groups)
    assert [last for _, last in groups] == [False, False, True]


def test_one_packed_bucket_per_sync_reserves_one_buffer_not_two():
    from slime_like.weights.packing import BucketPacker

    one = BucketPacker(CPU, capacity=1 << 20)
    one.reserve(4096, buckets=1)
    assert [b is not None for b in one._buffers] == [True, False]
    assert one._buffers[0].numel() == 4096
    many = BucketPacker(CPU, capacity=1 << 20)
    many.reserve(4096, buckets=5)
    assert all(b is not None and b.numel() == 4096 for b in many._buffers)


def test_a_refused_direct_view_is_packed():
    """The tensor transport refuses the trainer's storage when it is new since the last
    sync (an offloading trainer reallocates it every step): it is packed instead."""
    from slime_like.weights.packing import send_groups

    flat = torch.randn(1000)
    named = _named([flat[i * 100:(i + 1) * 100] for i in range(10)])
    asked = []

    def refuse(view: torch.Tensor) -> bool:
        asked.append(view.untyped_storage().data_ptr())
        return False
    groups = list(send_groups(iter(named), _buckets(named, 800), CPU, merge_direct=True,
                              allow_direct=refuse))
    assert len(groups) == 5 and all(g.view is None for g, _ in groups)
    assert set(asked) == {flat.untyped_storage().data_ptr()}


def test_a_refused_direct_bucket_is_packed_from_its_contiguous_bytes_in_one_copy():
    # The offloading trainer's flat buffer is new every sync, so it is not sent in place;
    # its buckets still lie back to back, so the pack is one copy of their bytes.
    from slime_like.protocol.buckets import layout
    from slime_like.weights.packing import BucketPacker, send_groups

    flat = torch.randn(1000)
    named = _named([flat[i * 100:(i + 1) * 100].view(10, 10) for i in range(10)])
    buckets = _buckets(named, 800)
    groups = list(send_groups(iter(named), buckets, CPU, merge_direct=True,
                              allow_direct=lambda view: False))
    assert len(groups) == 5  # not merged: each goes through the pack buffer
    packer = BucketPacker(CPU, 800)
    for group, _ in groups:
        assert group.view is None and group.pack_sources() == [group.contiguous]
        assert group.contiguous.data_ptr() == group.tensors[0].data_ptr()
        packed = packer.pack(0, group.pack_sources(), group.nbytes)
        for entry, tensor in zip(layout(group.metas), group.tensors, strict=True):
            assert torch.equal(packed[entry.start_idx:entry.end_idx].view(torch.float32),
                               tensor.flatten())
    scattered = [(f"s{i}", torch.randn(10)) for i in range(4)]  # separate storages
    (group, _), = send_groups(iter(scattered), _buckets(scattered, 1000), CPU,
                              merge_direct=True, allow_direct=lambda view: False)
    assert group.contiguous is None and group.pack_sources() == group.tensors
