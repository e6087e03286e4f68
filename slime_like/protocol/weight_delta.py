"""Delta weight updates on the wire: what both programs agree on (sender and reference engine).

A delta bucket is the bitwise XOR of a bucket's new bytes with the bytes the engine already
holds (the same flat layout as a `flattened_bucket`: tensors concatenated in order, no
padding), compressed with zstd. After an optimizer step most bf16 values keep their bit
pattern, so the XOR is mostly zero bytes and compresses to a fraction of the bucket.

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


class DeltaEncoder:
    """One bucket's delta, streamed: each piece of the new bytes is XORed with the base,
    compressed, and copied over the base, so the base becomes the new bytes in place.

    Pieces of at most `CHUNK_BYTES` stay in the CPU's cache from the XOR through zstd and
    the digest, and no bucket-sized copy of the new bytes is made: the encode reads the
    new bytes once and the base twice. A failed encode leaves the base half new: the
    caller must forget it.
    """

    def __init__(self, base: np.ndarray, sink: BinaryIO, scratch: np.ndarray):
        self.base, self.scratch, self.sink = base, scratch, sink
        self.offset, self._start = 0, sink.tell()
        # threads=-1: zstd splits the stream over every core (one frame; decoding is the
        # same); size: the frame records the bucket's size, and zstd checks it was met
        self._z = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).stream_writer(
            sink, size=base.size, closefd=False)
        self._hash = xxhash.xxh3_64()

    def write(self, piece: np.ndarray) -> None:
        """The next `piece.size` bytes of the bucket (any size up to the scratch's)."""
        n = piece.size
        if self.offset + n > self.base.size:
            raise ValueError(f"the bucket's tensors hold more than the base's {self.base.size} "
                             "bytes")
        old, xor = self.base[self.offset:self.offset + n], self.scratch[:n]
        xor_into(old, piece, xor)
        self._z.write(memoryview(xor))
        np.copyto(old, piece)
        self._hash.update(memoryview(old))
        self.offset += n

    def finish(self) -> tuple[str, int]:
        """End the frame: (the new bytes' digest, the compressed size written)."""
        if self.offset != self.base.size:
            raise ValueError(f"the bucket's tensors hold {self.offset} bytes, the base "
                             f"{self.base.size}")
        self._z.flush(zstandard.FLUSH_FRAME)
        return self._hash.hexdigest(), self.sink.tell() - self._start


class DeltaDecoder:
    """A delta's XOR bytes, decompressed piece by piece into the caller's buffers."""

    def __init__(self, blob: bytes | memoryview | np.ndarray):
        data = memoryview(np.ascontiguousarray(blob)) if isinstance(blob, np.ndarray) else blob
        self._reader = zstandard.ZstdDecompressor().stream_reader(data)
        self.offset = 0

    def read_into(self, out: np.ndarray) -> None:
        """Fill `out` (uint8) with the next `out.size` bytes of the XOR."""
        view, got = memoryview(out), 0
        while got < out.size:
            n = self._reader.readinto(view[got:])
            if n == 0:
                raise ValueError(f"the delta decodes to {self.offset + got} bytes, the bucket "
                                 f"holds more")
            got += n
        self.offset += got

    def finish(self) -> None:
        """The XOR must end where the bucket does."""
        if self._reader.read(1):
            raise ValueError(f"the delta decodes to more than the bucket's {self.offset} bytes")


def encode(base: np.ndarray, new: np.ndarray, scratch: np.ndarray | None = None) -> bytes:
    """zstd(base XOR new) in one call (the streamed `DeltaEncoder` on a copy of the base)."""
    if base.shape != new.shape:
        raise ValueError(f"delta base holds {base.size} bytes, the bucket {new.size}")
    sink = io.BytesIO()
    encoder = DeltaEncoder(base.copy(), sink, scratch if scratch is not None
                           else np.empty(min(new.size, CHUNK_BYTES), dtype=np.uint8))
    for start in range(0, new.size, encoder.scratch.size or 1):
        encoder.write(new[start:start + encoder.scratch.size])
    encoder.finish()
    return sink.getvalue()


def apply(current: np.ndarray, blob: bytes | memoryview | np.ndarray) -> None:
    """current ^= the decoded blob, in place, piece by piece; sizes must match exactly."""
    decoder, xor = DeltaDecoder(blob), np.empty(min(current.size, CHUNK_BYTES), dtype=np.uint8)
    for start in range(0, current.size, xor.size or 1):
        part = current[start:start + xor.size]
        decoder.read_into(xor[:part.size])
        xor_into(part, xor[:part.size], part)
    decoder.finish()


def xor_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a ^ b over uint8 arrays of one size, as 8-byte words when all three allow it
    (several times faster than byte by byte)."""
    if all(x.size % 8 == 0 and x.ctypes.data % 8 == 0 for x in (a, b, out)):
        a, b, out = a.view(np.uint64), b.view(np.uint64), out.view(np.uint64)
    np.bitwise_xor(a, b, out=out)


def supports_delta(server_info: dict, encoding: str = XOR_ZSTD) -> bool:
    """Whether an engine's /server_info advertises this delta format."""
    return encoding in (server_info.get(SERVER_INFO_KEY) or ())
