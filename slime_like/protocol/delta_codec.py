"""The delta codec on every core: a bucket's XOR encoded and applied one frame per thread.

The wire format (frames, header, digests) is `protocol/weight_delta.py`. Here, both sides cut
a bucket's bytes, given in order as pieces of any size (a bucket's tensors), at the frames'
grid, and hand each whole frame to one of the process's codec threads (`codec_pool`), which
does all of that frame's work while it is in cache:

  trainer  XOR the new bytes with the base into the frame's buffer, copy them over the base,
           hash them, compress the buffer (`DeltaEncoder`)
  engine   decode the frame, hash its piece of the current bytes, XOR them in, hash the
           result (`decode_onto`)

The calling thread only cuts and keeps the frames' order, so nothing runs serially in
proportion to the bucket's size: numpy's XOR and copy, zstd and xxhash all release the GIL.
"""

from __future__ import annotations

import io
import os
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import xxhash
import zstandard

from slime_like.protocol.weight_delta import (
    CHUNK_BYTES,
    ZSTD_LEVEL,
    combine_digests,
    frame_count,
    frame_digest,
)

#: codec threads of this process: one per core it may run on; the affinity, not the host's
#: count, where the process is pinned to some cores
CODEC_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
    os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_codecs = threading.local()

#: a piece of one frame: bytes (uint8) and where they start in the frame
Segment = tuple[np.ndarray, int]


def codec_pool() -> ThreadPoolExecutor:
    """The process's codec threads (`CODEC_THREADS`)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="delta-codec")
        return _pool


def xor_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a ^ b over uint8 arrays of one size, as 8-byte words when all three allow it
    (several times faster than byte by byte)."""
    if all(x.size % 8 == 0 and x.ctypes.data % 8 == 0 for x in (a, b, out)):
        a, b, out = a.view(np.uint64), b.view(np.uint64), out.view(np.uint64)
    np.bitwise_xor(a, b, out=out)


class FrameGrid:
    """Cuts a bucket's bytes, given in order as pieces of any size, at the frames' grid."""

    def __init__(self, nbytes: int):
        self.nbytes, self.offset = nbytes, 0
        self._frame, self._segments = 0, []

    def add(self, piece: np.ndarray) -> list[tuple[int, list[Segment]]]:
        """The next `piece.size` bytes; returns the frames they completed (index, pieces)."""
        if self.offset + piece.size > self.nbytes:
            raise ValueError(f"the bucket's tensors hold more than the base's {self.nbytes} "
                             "bytes")
        complete, done = [], 0
        while done < piece.size:
            frame_start = self._frame * CHUNK_BYTES
            frame_len = min(CHUNK_BYTES, self.nbytes - frame_start)
            fill = self.offset - frame_start
            take = min(piece.size - done, frame_len - fill)
            self._segments.append((piece[done:done + take], fill))
            self.offset, done = self.offset + take, done + take
            if fill + take == frame_len:
                complete.append((self._frame, self._segments))
                self._frame, self._segments = self._frame + 1, []
        return complete


# ---- the trainer's side --------------------------------------------------------------------

def _compressor() -> zstandard.ZstdCompressor:
    compressor = getattr(_codecs, "compressor", None)
    if compressor is None:
        compressor = _codecs.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return compressor


def _encode_frame(base: np.ndarray, segments: list[Segment], xor: np.ndarray
                  ) -> tuple[int, bytes]:
    """One frame, on a codec thread: (the new bytes' digest, the compressed XOR; its content
    size recorded, so a decode checks it). The base frame becomes the new bytes."""
    for new, at in segments:
        old = base[at:at + new.size]
        xor_into(old, new, xor[at:at + new.size])
        np.copyto(old, new)
    return frame_digest(base), _compressor().compress(memoryview(xor))


class DeltaEncoder:
    """One bucket's delta, streamed: each whole frame of the new bytes is XORed with the
    base, copied over it (the base becomes the new bytes in place), hashed and compressed on
    a codec thread; the frames are written to `sink` in order.

    The pieces given to `write` are read on the codec threads, after `write` returns (until
    `finish`): they must not change before then (views of the model's tensors do not during
    a sync; a GPU tensor's piece is a fresh host copy). No bucket-sized copy is made: at most
    `MAX_BUFFERS` frame buffers, taken from and given back to `buffers` (the caller's, kept
    across buckets). A failed encode leaves the base half new: the caller must forget it.
    """

    MAX_BUFFERS = CODEC_THREADS + 2  # every codec thread busy, one being filled, one spare

    def __init__(self, base: np.ndarray, sink: BinaryIO, buffers: list[np.ndarray] | None = None):
        self.base, self.sink = base, sink
        self.frames: list[int] = []
        self._digests: list[int] = []
        self._grid = FrameGrid(base.size)
        self._spare = buffers if buffers is not None else []
        self._made = len(self._spare)
        self._in_flight: deque[tuple[Future[tuple[int, bytes]], np.ndarray]] = deque()

    @property
    def offset(self) -> int:
        """How many bytes of the bucket were given so far."""
        return self._grid.offset

    def write(self, piece: np.ndarray) -> None:
        """The next `piece.size` bytes of the bucket (uint8)."""
        for k, segments in self._grid.add(piece):
            base = self.base[k * CHUNK_BYTES:(k + 1) * CHUNK_BYTES]
            buffer = self._free_buffer()
            self._in_flight.append((codec_pool().submit(_encode_frame, base, segments,
                                                        buffer[:base.size]), buffer))

    def _free_buffer(self) -> np.ndarray:
        if self._spare:
            return self._spare.pop()
        if self._made < self.MAX_BUFFERS:
            self._made += 1
            return np.empty(CHUNK_BYTES, dtype=np.uint8)
        return self._write_oldest()

    def _write_oldest(self) -> np.ndarray:
        future, buffer = self._in_flight.popleft()
        digest, frame = future.result()
        self.sink.write(frame)
        self.frames.append(len(frame))
        self._digests.append(digest)
        return buffer

    def finish(self) -> tuple[str, list[int]]:
        """Write the last frames: (the new bytes' digest, each frame's compressed size)."""
        if self.offset != self.base.size:
            self.close()
            raise ValueError(f"the bucket's tensors hold {self.offset} bytes, the base "
                             f"{self.base.size}")
        while self._in_flight:
            self._spare.append(self._write_oldest())
        return combine_digests(self._digests), self.frames

    def close(self) -> None:
        """A failed encode: wait for the frames in flight (they use our buffers)."""
        for future, buffer in self._in_flight:
            future.exception()
            self._spare.append(buffer)
        self._in_flight.clear()


# ---- the engine's side ---------------------------------------------------------------------

@dataclass
class Decoded:
    """What `decode_onto` found: the current bytes' digest (always), the result's digest
    (None when the blob did not decode) and why it did not."""

    base_checksum: str
    checksum: str | None
    error: str | None


def _decode_frame(frame: memoryview | None, out: np.ndarray, segments: list[Segment]
                  ) -> tuple[int, int | None, str | None]:
    """One frame, on a codec thread: (the current bytes' digest, the result's, an error)."""
    base = xxhash.xxh3_64()
    for current, _ in segments:
        base.update(memoryview(current))
    if frame is None:
        return base.intdigest(), None, None
    try:
        _decompress(frame, out)
    except Exception as e:  # noqa: BLE001 - a corrupt blob is the caller's refusal
        return base.intdigest(), None, str(e) or type(e).__name__
    for current, at in segments:
        piece = out[at:at + current.size]
        xor_into(piece, current, piece)
    return base.intdigest(), frame_digest(out), None


def _decompress(frame: memoryview, out: np.ndarray) -> None:
    """One frame into `out`, which it must fill exactly."""
    reader = zstandard.ZstdDecompressor().stream_reader(frame)
    view, got = memoryview(out), 0
    while got < out.size:
        n = reader.readinto(view[got:])
        if n == 0:
            raise ValueError(f"a delta frame decodes to {got} bytes, its piece holds "
                             f"{out.size}")
        got += n
    if reader.read(1):
        raise ValueError(f"a delta frame decodes to more than its piece's {out.size} bytes")


def _frame_blobs(blob: bytes | memoryview | np.ndarray, frames: list[int], nbytes: int
                 ) -> list[memoryview]:
    data = memoryview(np.ascontiguousarray(blob)) if isinstance(blob, np.ndarray) else \
        memoryview(blob)
    if len(frames) != frame_count(nbytes):
        raise ValueError(f"the delta has {len(frames)} frames, a bucket of {nbytes} "
                         f"bytes {frame_count(nbytes)}")
    if sum(frames) != data.nbytes:
        raise ValueError(f"the delta's frames hold {sum(frames)} bytes, the blob "
                         f"{data.nbytes}")
    out, start = [], 0
    for size in frames:
        out.append(data[start:start + size])
        start += size
    return out


def decode_onto(current: Iterable[np.ndarray], blob: bytes | memoryview | np.ndarray,
                frames: list[int], out: np.ndarray) -> Decoded:
    """`out` (uint8, the bucket's size) = the current bytes, given in order as pieces,
    XOR the decoded blob; the current bytes are only read. Every frame runs on the codec
    threads as soon as its pieces are given. The current bytes' digest is taken even when
    the blob does not decode, so a wrong base is named as such first."""
    try:
        blobs: list[memoryview | None] = _frame_blobs(blob, frames, out.size)
        error = None
    except ValueError as e:
        blobs, error = [None] * frame_count(out.size), str(e)
    grid, futures = FrameGrid(out.size), []
    try:
        for piece in current:
            for k, segments in grid.add(piece):
                futures.append(codec_pool().submit(
                    _decode_frame, blobs[k], out[k * CHUNK_BYTES:(k + 1) * CHUNK_BYTES],
                    segments))
        if grid.offset != out.size:
            raise ValueError(f"the current bytes hold {grid.offset}, the bucket {out.size}")
        results = [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                f.exception()  # running ones write into `out`: wait for them
    error = error or next((e for _, _, e in results if e is not None), None)
    return Decoded(combine_digests([b for b, _, _ in results]), None if error else
                   combine_digests([r for _, r, _ in results]), error)


# ---- whole buckets at once -----------------------------------------------------------------

def encode(base: np.ndarray, new: np.ndarray) -> tuple[bytes, list[int]]:
    """(zstd frames of base XOR new, their sizes) in one call (on a copy of the base)."""
    if base.shape != new.shape:
        raise ValueError(f"delta base holds {base.size} bytes, the bucket {new.size}")
    sink = io.BytesIO()
    encoder = DeltaEncoder(base.copy(), sink)
    encoder.write(new)
    _, frames = encoder.finish()
    return sink.getvalue(), frames


def apply(current: np.ndarray, blob: bytes | memoryview | np.ndarray, frames: list[int]) -> None:
    """current ^= the decoded blob, in place; sizes must match exactly."""
    out = np.empty_like(current)
    decoded = decode_onto([current], blob, frames, out)
    if decoded.error is not None:
        raise ValueError(decoded.error)
    np.copyto(current, out)
