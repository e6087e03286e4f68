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

import numpy as np
import torch
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


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat uint8 numpy view (no copy when contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def encode(base: np.ndarray, new: np.ndarray, scratch: np.ndarray | None = None) -> bytes:
    """zstd(base XOR new); `scratch` (same size, uint8) avoids an allocation per bucket."""
    if base.shape != new.shape:
        raise ValueError(f"delta base holds {base.size} bytes, the bucket {new.size}")
    out = scratch if scratch is not None and scratch.size == new.size else np.empty_like(new)
    np.bitwise_xor(_wide(base), _wide(new), out=_wide(out))
    # threads=-1: zstd splits the bucket over every core (one frame; decoding is unchanged)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).compress(memoryview(out))


def apply(current: np.ndarray, blob: bytes | memoryview) -> None:
    """current ^= zstd-decoded blob, in place; the decoded size must equal the bucket's."""
    xor = zstandard.ZstdDecompressor().decompress(blob, max_output_size=current.size)
    if len(xor) != current.size:
        raise ValueError(f"the delta decodes to {len(xor)} bytes, the bucket holds "
                         f"{current.size}")
    decoded = _wide(np.frombuffer(xor, dtype=np.uint8))
    np.bitwise_xor(_wide(current), decoded, out=_wide(current))


def _wide(a: np.ndarray) -> np.ndarray:
    """The same bytes as 8-byte words when they divide evenly (XOR runs several times faster)."""
    return a.view(np.uint64) if a.size % 8 == 0 and a.ctypes.data % 8 == 0 else a


def supports_delta(server_info: dict, encoding: str = XOR_ZSTD) -> bool:
    """Whether an engine's /server_info advertises this delta format."""
    return encoding in (server_info.get(SERVER_INFO_KEY) or ())
