"""The `tensor` transport's mappings across syncs, CPU form (named shared memory): a real
reference engine process, real syncs, the engine's own memory map read from /proc.

A trainer buffer that stays the same is kept mapped by the engine from its second sync
on (the first sync cannot know it stays); it is let go of when the buffer moves, when the
trainer renews its pack buffers, and before the trainer frees it (an offload); a segment
both sides let go of is unlinked (no leak). The weights land byte for byte every sync.
The GPU form is in tests/reference_engine/test_gpu.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from weight_sync_helpers import Engine, start_engine

from slime_like.models.transformer import hf_named_parameters
from slime_like.protocol.checksums import overall_checksum, tensor_checksum
from slime_like.weights import NamedTensors, WeightSync
from slime_like.weights.tensor import TensorTransport

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.isdir("/proc/self"),
                                reason="needs /dev/shm and /proc (Linux)")


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory) -> Iterator[Engine]:
    """An engine of its own: what it keeps mapped is this module's to read."""
    e = start_engine(tiny_model_dir, tmp_path_factory.mktemp("ipc-engine"), 1)
    try:
        yield e
    finally:
        e.process.terminate(grace=10)


def _segment(storage: torch.UntypedStorage) -> str:
    """The /dev/shm name of a storage in named shared memory (shared by name if need be)."""
    _, handle, _ = storage._share_filename_cpu_()
    return handle.decode().lstrip("/")


def _mapped(engine: Engine) -> dict[str, int]:
    """{shared-memory segment: how many mappings of it} in the engine's process."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{engine.process.pid}/maps").read_text().splitlines():
        path = line.split()[-1]
        if path.startswith("/dev/shm/"):
            name = path.removeprefix("/dev/shm/")
            out[name] = out.get(name, 0) + 1
    return out


def _exists(segment: str) -> bool:
    return os.path.exists(f"/dev/shm/{segment}")


def _flat_in_shared_memory(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as views of one flat buffer in named shared memory (same dtype)."""
    flat = torch.cat([t.detach().reshape(-1) for _, t in named])
    _segment(flat.untyped_storage())
    views, offset = [], 0
    for name, t in named:
        views.append((name, flat[offset:offset + t.numel()].view(t.shape)))
        offset += t.numel()
    return views


class _Source(NamedTensors):
    """A trainer's weights, with its word on whether they stay until the next sync."""

    stays = True

    def storage_stays(self) -> bool:
        return self.stays


def _sync(sync: WeightSync, engine: Engine, source: NamedTensors, step: int) -> dict:
    tensors = source.resident()
    torch._foreach_add_(tensors, 0.125)  # a train step: new values in the same storage
    report = sync.update(source, f"v{step}").as_dict()
    want = overall_checksum({n: tensor_checksum(t) for n, t in source.tensors()})
    assert engine.rank_checksums() == [want], f"sync {step}: the engine's weights differ"
    return report


def _weights(tiny_model_dir) -> list[tuple[str, torch.Tensor]]:
    from weight_sync_helpers import trainer_model

    named = list(hf_named_parameters(trainer_model(tiny_model_dir, seed=3)))
    assert {t.dtype for _, t in named} == {torch.float32}
    return [(n, t.detach().clone()) for n, t in named]


def test_a_flat_buffer_in_place_stays_mapped_while_it_stays_and_is_let_go_when_it_moves_or_is_freed(
        engine, tiny_model_dir):
    source = _Source(_flat_in_shared_memory(_weights(tiny_model_dir)))
    first = _segment(source.resident()[0].untyped_storage())
    sync = WeightSync([(engine.url, 1)], transport="tensor", update_weight_buffer_size=64 << 10,
                      http_timeout_s=60)
    try:
        report = _sync(sync, engine, source, 1)
        assert report["transfer"]["buckets"] == 1 and report["transfer"]["pack_s"] == 0.0
        # first sync: nothing says the buffer stays, so the engine closed it at the end
        assert first not in _mapped(engine)
        _sync(sync, engine, source, 2)
        assert _mapped(engine).get(first) == 1  # sent again: kept past end_weight_update
        for step in (3, 4):
            _sync(sync, engine, source, step)
            assert _mapped(engine).get(first) == 1  # the same one mapping, not a second

        # The buffer moves (a new storage, the old one dropped): the engine lets go of the
        # old one at the end of the first sync that did not send it; then it is unlinked.
        source = _Source(_flat_in_shared_memory(list(source.tensors())))
        moved = _segment(source.resident()[0].untyped_storage())
        assert _exists(first)  # the engine still maps it
        _sync(sync, engine, source, 5)
        assert first not in _mapped(engine) and not _exists(first), "old buffer leaked"
        assert moved not in _mapped(engine)  # new: not known to stay yet
        _sync(sync, engine, source, 6)
        assert _mapped(engine).get(moved) == 1

        # An offload is coming (the source says its buffer will not stay): that sync does
        # not ask to keep it, so the buffer is freed for real once the trainer drops it.
        source.stays = False
        _sync(sync, engine, source, 7)
        assert moved not in _mapped(engine)
        # offloaded: the trainer's copy moves elsewhere and the shared buffer is dropped
        source = _Source([(n, t.clone()) for n, t in source.tensors()])
        assert not _exists(moved), "the freed buffer is still held"
    finally:
        sync.close()


def test_pack_buffers_stay_mapped_across_syncs_until_the_trainer_renews_them(
        engine, tiny_model_dir):
    source = NamedTensors(_weights(tiny_model_dir))  # separate tensors: every bucket packed
    sync = WeightSync([(engine.url, 1)], transport="tensor", update_weight_buffer_size=64 << 10,
                      http_timeout_s=60)
    try:
        sync.attach(source)
        transport = sync._transport()
        assert isinstance(transport, TensorTransport)
        transport.renew_every = 3
        mapped = []
        for step in range(1, 7):
            report = _sync(sync, engine, source, step)
            assert report["transfer"]["buckets"] > 2  # more buckets than pack buffers
            segments = {_segment(b.untyped_storage()) for b in transport.packer._buffers
                        if b is not None}
            assert len(segments) == 2
            mapped.append((segments, {s for s in segments if _mapped(engine).get(s) == 1}))
        # syncs 1, 3, 4, 6 keep them; 2 and 5 come before a renewal (3 and 6) and do not
        (s1, m1), (s2, m2), (s3, m3), (s4, m4), (s5, m5), (s6, m6) = mapped
        assert m1 == s1 and m2 == set() and m3 == s3 and m4 == s4 and m5 == set() and m6 == s6
        assert s1 == s2 and s3 == s4 == s5 and s6.isdisjoint(s3) and s3.isdisjoint(s1)
        assert not any(_exists(s) for s in s1 | s3), "renewed pack buffers leaked"
    finally:
        sync.close()
    # closing asks the engine to let go of what it kept for us: nothing left behind
    assert not set(_mapped(engine)) & s6 and not any(_exists(s) for s in s6)


def _mapping_stats(engine: Engine) -> dict[str, int]:
    body = engine.post("/weights_checker", {"action": "checksum"}).json()
    return body["ranks"][0]["ipc_mappings"]


def test_separate_parameters_in_shared_memory_go_in_place_shared_once_while_they_stay(
        engine, tiny_model_dir):
    """Separate parameters (not one flat buffer) in shared memory: the first sync packs
    them (nothing says they stay); from the second on they go in place, one request, each
    parameter mapped once by the engine, and the later syncs send the same share again,
    which the engine reuses without opening anything. A parameter that moves, or a source
    that says its storages will not stay, sends them packed again and the engine lets go
    of every mapping; the moved storage is then freed for real."""
    named = _weights(tiny_model_dir)
    for _, t in named:
        _segment(t.untyped_storage())  # each parameter its own named segment
    source = _Source(named)
    segments = {n: _segment(t.untyped_storage()) for n, t in named}
    sync = WeightSync([(engine.url, 1)], transport="tensor", update_weight_buffer_size=64 << 10,
                      http_timeout_s=60)

    def params_mapped() -> dict[str, int]:
        maps = _mapped(engine)
        return {n: maps.get(s, 0) for n, s in segments.items()}

    try:
        report = _sync(sync, engine, source, 1)
        assert report["transfer"]["buckets"] > 2 and report["transfer"]["pack_s"] > 0
        assert set(params_mapped().values()) == {0}
        report = _sync(sync, engine, source, 2)
        assert report["transfer"]["buckets"] == 1 and report["transfer"]["pack_s"] == 0.0
        assert set(params_mapped().values()) == {1}, "every parameter mapped once, and kept"
        before = _mapping_stats(engine)
        for step in (3, 4):
            report = _sync(sync, engine, source, step)  # new values, same storages
            assert report["transfer"]["buckets"] == 1
            assert set(params_mapped().values()) == {1}
        after = _mapping_stats(engine)
        assert after["reused"] - before["reused"] == 2 and after["opened"] == before["opened"]

        # One parameter moves (a new storage): that sync packs, and the engine lets go of
        # every mapping at its end; the old storage is then freed for real.
        moved_name, moved = named[0][0], named[0][1]
        named[0] = (moved_name, moved.clone())
        _segment(named[0][1].untyped_storage())
        old_segment, segments[moved_name] = segments[moved_name], _segment(
            named[0][1].untyped_storage())
        source = _Source(named)
        del moved
        report = _sync(sync, engine, source, 5)
        assert report["transfer"]["buckets"] > 2
        assert set(params_mapped().values()) == {0}
        assert not _exists(old_segment), "the moved parameter's old storage leaked"
        report = _sync(sync, engine, source, 6)  # in place again: a fresh share
        assert report["transfer"]["buckets"] == 1 and set(params_mapped().values()) == {1}

        source.stays = False  # an offload is coming: packed, and nothing kept past it
        report = _sync(sync, engine, source, 7)
        assert report["transfer"]["buckets"] > 2 and set(params_mapped().values()) == {0}
        source.stays = True  # back after the offload: packed once more, then in place
        assert _sync(sync, engine, source, 8)["transfer"]["buckets"] > 2
        assert _sync(sync, engine, source, 9)["transfer"]["buckets"] == 1
        assert set(params_mapped().values()) == {1}
    finally:
        sync.close()
    assert set(params_mapped().values()) == {0}, "close() left parameters mapped"
