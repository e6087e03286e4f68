"""Our trainer side and sglang's own engine-side code form one weight group over gloo.

The engine side runs exactly what an sglang scheduler runs: `init_custom_process_group` at
rank `rank_offset + tp_rank`, per-tensor async broadcasts, and for `flattened_bucket`
`FlattenedTensorBucket.empty(...)` + one broadcast + `reconstruct_tensors()`.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_like.protocol.buckets import (
    TensorMeta,
    dtype_name,
    flatten,
    flatten_into,
    layout,
    plan_buckets,
)
from slime_like.protocol.weight_group import (
    destroy_process_group,
    init_custom_process_group,
    tcp_init_method,
)

pytestmark = pytest.mark.sglang

ENGINE_TP_SIZES = [1, 2]  # engine A (TP=1) and engine B (TP=2): world_size = 1 + 3
GROUP_NAMES = ["slime_like_weights_attempt0", "slime_like_weights_attempt1"]


def mixed_named_tensors() -> list[tuple[str, torch.Tensor]]:
    """fp32, bf16, fp16 and int64, odd sizes, in an order that is NOT aligned as given."""
    g = torch.Generator().manual_seed(3)
    return [
        ("model.layers.0.input_layernorm.weight", torch.randn(13, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(5, 7, generator=g)),
        ("model.layers.0.mlp.gate.e_score_bias", torch.randn(3, generator=g).to(torch.float16)),
        ("model.layers.0.mlp.expert_ids", torch.arange(9, dtype=torch.int64) * 3),
        ("model.layers.1.self_attn.k_proj.weight", torch.randn(1, 3, 3, generator=g)),
        ("model.norm.weight", torch.randn(1, generator=g).to(torch.bfloat16)),
    ]


def _engine_rank(rank: int, port: int, world_size: int, plan: dict, out) -> None:
    """One engine TP rank, using sglang's functions only."""
    from sglang.srt.utils.common import init_custom_process_group as sglang_init
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    got = {}
    for group_name in GROUP_NAMES:
        pg = sglang_init(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                         world_size=world_size, rank=rank, group_name=group_name)
        # per-tensor mode, as WeightUpdater.receive_weights_from_distributed does it
        weights, handles = [], []
        for name, dtype, shape in plan["per_tensor"]:
            w = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(w, src=0, group=pg, async_op=True))
            weights.append((name, w))
        for h in handles:
            h.wait()
        # flattened_bucket mode, one broadcast per bucket
        for names, dtypes, shapes in plan["buckets"]:
            bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
            weights += [(f"bucket:{n}", t) for n, t in bucket.reconstruct_tensors()]
        # plain bytes back to the parent: a tensor in a Queue travels as a shared fd that the
        # parent could try to fetch after this process exited
        got[group_name] = [(n, str(t.dtype), list(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                           for n, t in weights]
        dist.destroy_process_group(pg)
    out.put((rank, got))


def _from_bytes(dtype: str, shape: list[int], raw: bytes) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(getattr(torch, dtype.removeprefix("torch."))).view(shape)


@pytest.fixture(scope="module")
def broadcast_results(tmp_path_factory):
    """Run trainer + 3 engine ranks once; returns (sent tensors, {rank: {group: received}})."""
    pytest.importorskip("sglang.srt.weight_sync.tensor_bucket",
                        reason="sglang 0.5.23 (--no-deps) is not importable here")
    named = mixed_named_tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    buckets = plan_buckets(metas, max_bytes=48)  # several buckets, mixed dtypes in each
    by_name = dict(named)
    plan = {
        "per_tensor": [(n, dtype_name(t.dtype), list(t.shape)) for n, t in named],
        "buckets": [([m.name for m in b.metas], [dtype_name(m.dtype) for m in b.metas],
                     [list(m.shape) for m in b.metas]) for b in buckets],
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world_size = 1 + sum(ENGINE_TP_SIZES)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_engine_rank, args=(r, port, world_size, plan, q), daemon=True)
             for r in range(1, world_size)]
    for p in procs:
        p.start()
    try:
        for group_name in GROUP_NAMES:
            pg = init_custom_process_group(backend="gloo", init_method=tcp_init_method("127.0.0.1", port),
                                           world_size=world_size, rank=0, group_name=group_name,
                                           timeout=120)
            for _, t in named:
                dist.broadcast(t, src=0, group=pg)
            for b in buckets:
                buf = torch.empty(b.nbytes, dtype=torch.uint8)
                flatten_into([by_name[m.name] for m in b.metas], buf)
                dist.broadcast(buf, src=0, group=pg)
            destroy_process_group(pg)
        received = {}
        for _ in procs:
            rank, got = q.get(timeout=180)
            received[rank] = {g: [(n, _from_bytes(d, shape, raw)) for n, d, shape, raw in items]
                              for g, items in got.items()}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return named, received


def test_every_engine_rank_joins_at_rank_offset_plus_tp_rank(broadcast_results):
    _, received = broadcast_results
    offsets = [1 + sum(ENGINE_TP_SIZES[:i]) for i in range(len(ENGINE_TP_SIZES))]
    expected = sorted(off + tp for off, size in zip(offsets, ENGINE_TP_SIZES, strict=True)
                      for tp in range(size))
    assert sorted(received) == expected == [1, 2, 3]


def test_per_tensor_broadcasts_arrive_intact_on_every_rank(broadcast_results):
    named, received = broadcast_results
    for per_group in received.values():
        for got in per_group.values():
            per_tensor = [(n, t) for n, t in got if not n.startswith("bucket:")]
            assert [n for n, _ in per_tensor] == [n for n, _ in named]
            for (_, sent), (_, t) in zip(named, per_tensor, strict=True):
                assert t.dtype == sent.dtype and torch.equal(t, sent)


def test_flattened_buckets_arrive_intact_on_every_rank(broadcast_results):
    named, received = broadcast_results
    sent = dict(named)
    for per_group in received.values():
        for got in per_group.values():
            bucketed = {n.removeprefix("bucket:"): t for n, t in got if n.startswith("bucket:")}
            assert set(bucketed) == set(sent)
            for name, t in bucketed.items():
                assert t.dtype == sent[name].dtype and torch.equal(t, sent[name])


def test_group_is_destroyed_and_recreated_under_a_new_name(broadcast_results):
    _, received = broadcast_results
    for per_group in received.values():
        assert list(per_group) == GROUP_NAMES


def test_our_bucket_bytes_and_metadata_equal_sglangs(import_sglang):
    tensor_bucket = import_sglang("sglang.srt.weight_sync.tensor_bucket")
    metas = [TensorMeta.of(n, t) for n, t in mixed_named_tensors()]
    by_name = dict(mixed_named_tensors())
    for max_bytes in (1, 40, 64, 1 << 20):
        for b in plan_buckets(metas, max_bytes):
            named = [(m.name, by_name[m.name]) for m in b.metas]
            ours, our_meta = flatten(named)
            theirs = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
            assert torch.equal(ours, theirs.get_flattened_tensor())
            fields = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
            assert [[getattr(m, f) for f in fields] for m in our_meta] == \
                [[getattr(m, f) for f in fields] for m in theirs.get_metadata()]
            # sglang's receiver accepts the layout (its alignment rule) and agrees on offsets
            empty = tensor_bucket.FlattenedTensorBucket.empty(
                [m.name for m in b.metas], [dtype_name(m.dtype) for m in b.metas],
                [list(m.shape) for m in b.metas], "cpu")
            assert [(m.start_idx, m.end_idx) for m in empty.get_metadata()] == \
                [(m.start_idx, m.end_idx) for m in layout(b.metas)]


def test_an_unaligned_order_is_refused_by_both_sides(import_sglang):
    tensor_bucket = import_sglang("sglang.srt.weight_sync.tensor_bucket")
    metas = [TensorMeta("a", torch.bfloat16, (3,)), TensorMeta("b", torch.float32, (2,))]
    with pytest.raises(ValueError, match="Unaligned received tensor b"):
        layout(metas)
    with pytest.raises(ValueError, match="Unaligned received tensor b"):
        tensor_bucket.FlattenedTensorBucket.empty(["a", "b"], ["bfloat16", "float32"],
                                                  [[3], [2]], "cpu")
