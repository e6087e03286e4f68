"""The delta codec, streamed: what the trainer writes piece by piece decodes to the bucket.

The real transports and engines are in `tests/weights/test_delta_sync.py`; here the pieces
take sizes the tiny model never gives (odd byte counts, so the 8-byte word path and the byte
path meet inside one bucket, and pieces that straddle the frames' grid) and the blobs are
broken in the ways a refusal must catch.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import zstandard

from slime_like.protocol import delta_codec as codec
from slime_like.protocol import weight_delta as wd
from slime_like.weights.delta import DeltaBase, DeltaOutcome, host_pieces


def _bucket(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    base = rng.integers(0, 256, size, dtype=np.uint8)
    new = base.copy()
    changed = rng.integers(0, size, size // 50)
    new[changed] ^= rng.integers(1, 256, changed.size, dtype=np.uint8)
    return base, new


def test_pieces_of_any_size_encode_what_one_call_decodes():
    rng = np.random.default_rng(3)
    base, new = _bucket(rng, 3 * wd.CHUNK_BYTES + 13)
    held, sink, buffers = base.copy(), io.BytesIO(), []
    encoder = codec.DeltaEncoder(held, sink, buffers)
    offset = 0
    for n in [7, 1001, wd.CHUNK_BYTES, 3, wd.CHUNK_BYTES - 5, 2 * wd.CHUNK_BYTES]:
        encoder.write(new[offset:offset + n])
        offset += n
        if offset >= new.size:
            break
    checksum, frames = encoder.finish()
    assert np.array_equal(held, new), "the base must become the new bytes"
    assert checksum == wd.bucket_digest(new) and sum(frames) == len(sink.getvalue()) < new.size // 4
    assert len(frames) == 4 == wd.frame_count(new.size)  # one per CHUNK_BYTES, the last 13 B
    assert 0 < len(buffers) <= codec.DeltaEncoder.MAX_BUFFERS  # given back, for the next bucket
    engine = base.copy()
    codec.apply(engine, sink.getvalue(), frames)
    assert np.array_equal(engine, new)
    # each frame stands alone: frame 2 alone gives bytes [2, 3) x CHUNK_BYTES of the XOR
    start = sum(frames[:2])
    alone = zstandard.ZstdDecompressor().decompress(sink.getvalue()[start:start + frames[2]])
    piece = slice(2 * wd.CHUNK_BYTES, 3 * wd.CHUNK_BYTES)
    assert np.array_equal(np.frombuffer(alone, dtype=np.uint8), base[piece] ^ new[piece])


def test_the_engine_decodes_from_pieces_that_straddle_frames_and_names_both_digests():
    """An engine's current bytes come as its parameters, whose edges fall anywhere in the
    frames' grid: each frame still gets exactly its bytes, and the digests are the bucket's
    (a frame hashed where it is decoded, combined in order), equal to the trainer's."""
    rng = np.random.default_rng(5)
    base, new = _bucket(rng, 2 * wd.CHUNK_BYTES + 1031)
    blob, frames = codec.encode(base, new)
    cuts = [0, 5, wd.CHUNK_BYTES - 3, wd.CHUNK_BYTES + 9, 2 * wd.CHUNK_BYTES + 1000, base.size]
    out = np.empty_like(base)
    pieces = [base[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    decoded = codec.decode_onto(pieces, blob, frames, out)
    assert decoded.error is None and np.array_equal(out, new)
    assert decoded.base_checksum == wd.bucket_digest(base)
    assert decoded.checksum == wd.bucket_digest(new) != decoded.base_checksum
    # one byte of the base off in the last frame: the base digest says so, the blob decodes
    wrong = base.copy()
    wrong[-1] ^= 1
    other = codec.decode_onto([wrong], blob, frames, out)
    assert other.base_checksum != decoded.base_checksum and other.checksum != decoded.checksum
    # a blob that does not fit the bucket: named, and the base digest still taken
    short = codec.decode_onto([base], blob, frames[:-1], out)
    assert short.checksum is None and "the delta has 2 frames" in short.error
    assert short.base_checksum == decoded.base_checksum


def test_a_blob_for_another_size_or_a_broken_blob_is_an_error():
    rng = np.random.default_rng(4)
    base, new = _bucket(rng, wd.CHUNK_BYTES + 77)
    blob, frames = codec.encode(base, new)
    with pytest.raises(ValueError, match="decodes to more than"):
        codec.apply(base[:-1].copy(), blob, frames)
    with pytest.raises(ValueError, match=r"frame decodes to 77 bytes, its piece holds 78"):
        codec.apply(np.zeros(base.size + 1, dtype=np.uint8), blob, frames)
    with pytest.raises(ValueError, match="the delta has 2 frames, a bucket of"):
        codec.apply(np.zeros(3 * wd.CHUNK_BYTES, dtype=np.uint8), blob, frames)
    with pytest.raises(ValueError, match="frames hold .* bytes, the blob"):
        codec.apply(base.copy(), blob, [frames[0] + 1, frames[1]])
    broken = bytearray(blob)
    broken[len(broken) // 2] ^= 0xFF
    with pytest.raises(Exception):  # noqa: B017 - zstd's own error, whatever its class
        target = base.copy()
        codec.apply(target, bytes(broken), frames)
        assert np.array_equal(target, new), "a broken blob decoded to the right bytes"


def test_an_encode_that_fails_midway_forgets_the_base():
    """The base turns into the new bytes as the encode goes: a bucket whose tensors do not
    fill it leaves it half new, so the next sync must be full."""
    tensors = [torch.arange(1000, dtype=torch.int16), torch.arange(333, dtype=torch.uint8)]
    base = DeltaBase()
    held = np.concatenate(list(host_pieces(tensors)))
    base.buckets, base.checksums, base.version = [held], [wd.bucket_digest(held)], "1"
    base.outcome, base._base_version = DeltaOutcome("delta", ""), "1"
    with pytest.raises(ValueError, match="hold 2000 bytes"):
        base.encode(0, host_pieces(tensors[:1], chunk=64), io.BytesIO())
    assert base.version is None and base.buckets == []
