"""Bucket planning and the flattened byte layout."""

from __future__ import annotations

import pytest
import torch

from slime_like.protocol.buckets import (
    TensorMeta,
    dtype_from_name,
    flatten,
    layout,
    plan_buckets,
    unflatten,
)


def _mixed():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),   # 30 bytes
        ("b.fp32", torch.randn(7, generator=g)),                         # 28 bytes
        ("c.i64", torch.arange(3, dtype=torch.int64)),                   # 24 bytes
        ("d.fp16", torch.randn(1, 3, generator=g).to(torch.float16)),    # 6 bytes
        ("e.u8", torch.arange(5, dtype=torch.uint8)),                    # 5 bytes
    ]


def test_every_planned_bucket_satisfies_the_alignment_rule():
    metas = [TensorMeta.of(n, t) for n, t in _mixed()] * 3
    metas = [TensorMeta(f"{m.name}.{i}", m.dtype, m.shape) for i, m in enumerate(metas)]
    for limit in (1, 40, 64, 100, 10_000):
        buckets = plan_buckets(metas, limit)
        assert [m.name for b in buckets for m in sorted(b.metas, key=metas.index)] == [m.name for m in metas]
        for b in buckets:
            assert b.nbytes <= limit or len(b.metas) == 1
            for e in b.entries:
                assert e.start_idx % e.dtype.itemsize == 0


def test_flatten_then_unflatten_round_trips_values_and_dtypes():
    named = sorted(_mixed(), key=lambda nt: -nt[1].element_size())
    buf, entries = flatten(named)
    assert buf.dtype == torch.uint8 and buf.numel() == sum(t.numel() * t.element_size() for _, t in named)
    for (name, original), (name2, view) in zip(named, unflatten(buf, entries), strict=True):
        assert name == name2 and view.dtype == original.dtype and torch.equal(view, original)


def test_unaligned_layout_is_refused_with_the_tensor_name():
    with pytest.raises(ValueError, match=r"Unaligned received tensor w: byte offset 2"):
        layout([TensorMeta("v", torch.float16, (1,)), TensorMeta("w", torch.float32, (2,))])


def test_unknown_dtype_name_is_refused():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'bf16'"):
        dtype_from_name("bf16")
