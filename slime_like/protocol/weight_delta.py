"""Delta weight updates on the wire: what both programs agree on (sender and reference engine).

A delta bucket is the bitwise XOR of a bucket's new bytes with the bytes the engine already
holds (the same flat layout as a `flattened_bucket`: tensors concatenated in order, no
padding), compressed with zstd. After an optimizer step most bf16 values keep their bit
pattern, so the XOR is mostly zero bytes and compresses to a fraction of the bucket.

The blob is one independent zstd frame per `CHUNK_BYTES` of the bucket (the last shorter),
concatenated; the header lists each frame's compressed size. Independent frames let both
sides spread ALL the work over every core (`codec_pool`): on the trainer, one codec thread
per frame XORs its piece of the new bytes with the base, copies them over the base, hashes
them and compresses the XOR; on the engine, one per frame decodes, hashes its piece of the
current bytes, XORs them in and hashes the result. The calling thread only cuts the
bucket into frames and keeps their order. One zstd frame per bucket would decode on one
core, and a digest of the whole bucket would have to be taken in order, on one thread.

Every delta bucket names its base: the weight version the engine must be serving and the
digest of the bucket's current bytes; and its result: the digest of the bytes after the XOR.
A bucket's digest (`bucket_digest`) is the xxh3-64 of its frames' xxh3-64 digests (8 bytes
each, big-endian, in order): each frame is hashed where it is coded, on its own thread. An engine checks the version and the base digest before it changes a byte and the
result digest before it copies the bucket into its parameters, so a delta never lands on
the wrong base (XOR onto other bytes gives other bytes, which the result digest catches
too). An engine that can apply deltas says so in `/server_info` (`SERVER_INFO_KEY`); sglang
has no such key, so a real sglang engine is always sent full weights.

On disk a delta is a directory beside the full checkpoints: `MANIFEST` (a `DeltaManifest`)
and one `<k>.xor.zst` file per bucket. The codec itself, on the codec threads, is
`protocol/delta_codec.py`.
"""

from __future__ import annotations

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict

XOR_ZSTD = "xor_zstd"
DELTA_FORMATS = (XOR_ZSTD,)
#: /server_info key listing the delta formats an engine applies (absent in sglang)
SERVER_INFO_KEY = "weight_delta_formats"
MANIFEST = "delta.json"
#: in every refusal's message (the sender syncs again in full when it reads it)
REFUSED = "weight delta refused"
ZSTD_LEVEL = 1  # level 1: the XOR is mostly zeros; higher levels cost time, not bytes
#: one frame: the unit of work of one codec thread (XOR, copy, digest and zstd in cache)
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


def frame_digest(data: np.ndarray) -> int:
    """xxh3-64 of one frame's bytes (tens of GB/s: cheap next to the XOR)."""
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(data)))


def combine_digests(frame_digests: list[int]) -> str:
    """A bucket's digest from its frames' digests, in order, as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(b"".join(d.to_bytes(8, "big") for d in frame_digests))


def bucket_digest(data: np.ndarray) -> str:
    """The digest of a whole bucket's bytes (uint8, flat), cut at the frames' grid."""
    return combine_digests([frame_digest(data[start:start + CHUNK_BYTES])
                            for start in range(0, data.size, CHUNK_BYTES)])


def supports_delta(server_info: dict, encoding: str = XOR_ZSTD) -> bool:
    """Whether an engine's /server_info advertises this delta format."""
    return encoding in (server_info.get(SERVER_INFO_KEY) or ())


def frame_count(nbytes: int) -> int:
    """How many frames a bucket of `nbytes` is cut into."""
    return -(-nbytes // CHUNK_BYTES)
