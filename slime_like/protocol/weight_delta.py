"""Delta weight updates on the wire: what both programs agree on (sender and reference engine).

A delta bucket is the bitwise XOR of a bucket's new bytes with the bytes the engine already
holds (the same flat layout as a `flattened_bucket`: tensors concatenated in order, no
padding), compressed with zstd. After an optimizer step most bf16 values keep their bit
pattern, so the XOR is mostly zero bytes and compresses to a fraction of the bucket.

The blob is one independent zstd frame per `CHUNK_BYTES` of the bucket (the last shorter),
concatenated; the header lists each frame's compressed size. Independent frames let both
sides spread the codec over every core (`codec_pool`): the trainer compresses piece k+1
while it XORs piece k+2, and the engine decodes all frames at once while it checks, in
order, the pieces already decoded. One zstd frame per bucket would decode on one core.

Every delta bucket names its base: the weight version the engine must be serving and the
xxh3-64 digest of the bucket's current bytes; and its result: the digest of the bytes after
the XOR. An engine checks the version and the base digest before it changes a byte and the
result digest before it copies the bucket into its parameters, so a delta never lands on
the wrong base (XOR onto other bytes gives other bytes, which the result digest catches
too). An engine that can apply deltas says so in `/server_info` (`SERVER_INFO_KEY`); sglang
has no such key, so a real sglang engine is always sent full weights.

On disk a delta is a directory beside the full checkpoints: `MANIFEST` (a `DeltaManifest`)
and one `<k>.xor.zst` file per bucket.
"""

from __future__ import annotations

import io
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

import numpy as np
import xxhash
import zstandard
from pydantic import BaseModel, ConfigDict

XOR_ZSTD = "xor_zstd"
DELTA_FORMATS = (XOR_ZSTD,)
#: /server_info key listing the delta formats an engine applies (absent in sglang)
SERVER_INFO_KEY = "weight_delta_formats"
MANIFEST = "delta.json"
#: in every refusal's message (the sender syncs again in full when it reads it)
REFUSED = "weight delta refused"
ZSTD_LEVEL = 1  # level 1: the XOR is mostly zeros; higher levels cost time, not bytes
#: a streamed piece: small enough to stay in cache from the XOR through zstd and the digest
CHUNK_BYTES = 8 << 20


class DeltaHeader(BaseModel):
    """One delta bucket's base, result and encoded size."""

    model_config = ConfigDict(extra="forbid")

    encoding: str = XOR_ZSTD
    base_version: str
    base_checksum: str
    checksum: str
    encoded_nbytes: int
    nbytes: int  # the decoded bucket's size (the flat layout of names/dtypes/shapes)
    frames: list[int]  # each frame's compressed size; frame k holds bytes [k, k+1) x CHUNK_BYTES


class DeltaBucketFile(BaseModel):
    """One bucket of a delta directory: its tensors (in layout order), header and file."""

    model_config = ConfigDict(extra="forbid")

    file: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    header: DeltaHeader


class DeltaManifest(BaseModel):
    """A delta directory's table of contents (`MANIFEST`)."""

    model_config = ConfigDict(extra="forbid")

    encoding: str = XOR_ZSTD
    base_version: str
    version: str
    buckets: list[DeltaBucketFile]


def digest(data: np.ndarray | bytes | memoryview) -> str:
    """xxh3-64 of raw bytes as 16 hex digits (several GB/s: cheap next to the copy)."""
    return xxhash.xxh3_64_hexdigest(memoryview(np.ascontiguousarray(data)) if isinstance(
        data, np.ndarray) else data)


#: zstd threads of this process: one per core it may run on (zstd releases the GIL); the
#: affinity, not the host's count, where the process is pinned to some cores
CODEC_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
    os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_codecs = threading.local()


def codec_pool() -> ThreadPoolExecutor:
    """The process's zstd threads (`CODEC_THREADS`)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="delta-codec")
        return _pool


def _compress(piece: np.ndarray) -> bytes:
    """One frame (its content size recorded, so a decode checks it), on a codec thread."""
    compressor = getattr(_codecs, "compressor", None)
    if compressor is None:
        compressor = _codecs.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return compressor.compress(memoryview(piece))


def frame_count(nbytes: int) -> int:
    """How many frames a bucket of `nbytes` is cut into."""
    return -(-nbytes // CHUNK_BYTES)


class DeltaEncoder:
    """One bucket's delta, streamed: each piece of the new bytes is XORed with the base into
    the current frame's buffer, and copied over the base, so the base becomes the new bytes
    in place; each full buffer is compressed on the codec threads, and the frames are
    written to `sink` in order.

    Pieces may have any size (a bucket's tensors cut at `CHUNK_BYTES` each); frames follow
    the bucket's own grid. No bucket-sized copy is made: the encode reads the new bytes once
    and the base twice, and holds at most `MAX_BUFFERS` frame buffers, taken from and given
    back to `buffers` (the caller's, kept across buckets). A failed encode leaves the base
    half new: the caller must forget it.
    """

    MAX_BUFFERS = CODEC_THREADS + 2  # every codec thread busy, one being filled, one spare

    def __init__(self, base: np.ndarray, sink: BinaryIO, buffers: list[np.ndarray] | None = None):
        self.base, self.sink = base, sink
        self.offset, self.frames = 0, []
        self._hash = xxhash.xxh3_64()
        self._spare = buffers if buffers is not None else []
        self._made = len(self._spare)
        self._buffer: np.ndarray | None = None
        self._fill = 0
        self._in_flight: deque[tuple[Future[bytes], np.ndarray]] = deque()

    def write(self, piece: np.ndarray) -> None:
        """The next `piece.size` bytes of the bucket."""
        n = piece.size
        if self.offset + n > self.base.size:
            raise ValueError(f"the bucket's tensors hold more than the base's {self.base.size} "
                             "bytes")
        done = 0
        while done < n:
            if self._buffer is None:
                self._buffer, self._fill = self._free_buffer(), 0
            frame_end = min(CHUNK_BYTES, self.base.size - (self.offset - self._fill))
            take = min(n - done, frame_end - self._fill)
            old = self.base[self.offset:self.offset + take]
            new = piece[done:done + take]
            xor_into(old, new, self._buffer[self._fill:self._fill + take])
            np.copyto(old, new)
            self._hash.update(memoryview(old))
            self.offset, self._fill, done = self.offset + take, self._fill + take, done + take
            if self._fill == frame_end:
                buffer, self._buffer = self._buffer, None
                self._in_flight.append(
                    (codec_pool().submit(_compress, buffer[:frame_end]), buffer))

    def _free_buffer(self) -> np.ndarray:
        if self._spare:
            return self._spare.pop()
        if self._made < self.MAX_BUFFERS:
            self._made += 1
            return np.empty(CHUNK_BYTES, dtype=np.uint8)
        return self._write_oldest()

    def _write_oldest(self) -> np.ndarray:
        future, buffer = self._in_flight.popleft()
        frame = future.result()
        self.sink.write(frame)
        self.frames.append(len(frame))
        return buffer

    def finish(self) -> tuple[str, list[int]]:
        """Write the last frames: (the new bytes' digest, each frame's compressed size)."""
        if self.offset != self.base.size:
            self.close()
            raise ValueError(f"the bucket's tensors hold {self.offset} bytes, the base "
                             f"{self.base.size}")
        while self._in_flight:
            self._spare.append(self._write_oldest())
        return self._hash.hexdigest(), self.frames

    def close(self) -> None:
        """A failed encode: wait for the frames in flight (they read our buffers)."""
        for future, buffer in self._in_flight:
            future.exception()
            self._spare.append(buffer)
        self._in_flight.clear()


class DeltaDecoder:
    """A delta's XOR bytes decoded into `out` (uint8, the bucket's size) on the codec
    threads, every frame at once; `wait_through` hands them over in order."""

    def __init__(self, blob: bytes | memoryview | np.ndarray, frames: list[int], out: np.ndarray):
        data = memoryview(np.ascontiguousarray(blob)) if isinstance(blob, np.ndarray) else \
            memoryview(blob)
        if len(frames) != frame_count(out.size):
            raise ValueError(f"the delta has {len(frames)} frames, a bucket of {out.size} "
                             f"bytes {frame_count(out.size)}")
        if sum(frames) != data.nbytes:
            raise ValueError(f"the delta's frames hold {sum(frames)} bytes, the blob "
                             f"{data.nbytes}")
        self._futures: list[Future[None]] = []
        start = 0
        for k, size in enumerate(frames):
            target = out[k * CHUNK_BYTES:(k + 1) * CHUNK_BYTES]
            self._futures.append(codec_pool().submit(_decompress, data[start:start + size],
                                                     target))
            start += size
        self._done = 0

    def wait_through(self, end: int) -> None:
        """Every byte before `end` decoded; a frame that did not decode raises here."""
        while self._done < len(self._futures) and self._done * CHUNK_BYTES < end:
            self._futures[self._done].result()
            self._done += 1

    def finish(self) -> None:
        """Every frame decoded (raises the first frame's error)."""
        self.wait_through(len(self._futures) * CHUNK_BYTES)

    def close(self) -> None:
        """Stop: frames not started are cancelled, the running ones waited for (they
        write into the caller's buffer)."""
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.cancelled():
                f.exception()


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


def encode(base: np.ndarray, new: np.ndarray) -> tuple[bytes, list[int]]:
    """(zstd frames of base XOR new, their sizes) in one call (on a copy of the base)."""
    if base.shape != new.shape:
        raise ValueError(f"delta base holds {base.size} bytes, the bucket {new.size}")
    sink = io.BytesIO()
    encoder = DeltaEncoder(base.copy(), sink)
    for start in range(0, new.size, CHUNK_BYTES):
        encoder.write(new[start:start + CHUNK_BYTES])
    _, frames = encoder.finish()
    return sink.getvalue(), frames


def apply(current: np.ndarray, blob: bytes | memoryview | np.ndarray, frames: list[int]) -> None:
    """current ^= the decoded blob, in place; sizes must match exactly."""
    xor = np.empty(current.size, dtype=np.uint8)
    decoder = DeltaDecoder(blob, frames, xor)
    try:
        decoder.finish()
    finally:
        decoder.close()
    xor_into(current, xor, current)


def xor_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a ^ b over uint8 arrays of one size, as 8-byte words when all three allow it
    (several times faster than byte by byte)."""
    if all(x.size % 8 == 0 and x.ctypes.data % 8 == 0 for x in (a, b, out)):
        a, b, out = a.view(np.uint64), b.view(np.uint64), out.view(np.uint64)
    np.bitwise_xor(a, b, out=out)


def supports_delta(server_info: dict, encoding: str = XOR_ZSTD) -> bool:
    """Whether an engine's /server_info advertises this delta format."""
    return encoding in (server_info.get(SERVER_INFO_KEY) or ())
