"""Buckets already back to back in the trainer's memory go out without a pack."""

from __future__ import annotations

import torch

from slime_like.weights.transfer import direct_view

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
