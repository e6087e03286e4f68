"""Flattened buckets: many tensors as one uint8 buffer, in sglang's byte layout.

The layout is sglang's `FlattenedTensorBucket`: tensors concatenated in list order, each
`numel * itemsize` bytes, no padding. sglang 0.5.23 refuses a tensor whose byte offset is
not a multiple of its itemsize, so the planner orders every bucket by descending itemsize;
then each offset is a sum of sizes that are multiples of the current itemsize.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_DTYPE_BY_NAME = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (sglang's wire form: a torch attribute, no 'torch.')."""
    dtype = _DTYPE_BY_NAME.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPE_BY_NAME)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver must know of a tensor before any byte moves."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, tensor.dtype, tuple(tensor.shape))


@dataclass
class FlattenedTensorMetadata:
    """One tensor's slot in a flat buffer; field names match sglang's class of this name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def layout(metas: Sequence[TensorMeta]) -> list[FlattenedTensorMetadata]:
    """Byte offsets of `metas` concatenated in order; raises on sglang's alignment rule."""
    out, offset = [], 0
    for m in metas:
        if any(d < 0 for d in m.shape):
            raise ValueError(f"negative dimension in tensor {m.name}: {m.shape}")
        if offset % m.dtype.itemsize:
            raise ValueError(
                f"Unaligned received tensor {m.name}: byte offset {offset}, dtype {m.dtype}")
        size = m.nbytes
        out.append(FlattenedTensorMetadata(m.name, torch.Size(m.shape), m.dtype, offset,
                                           offset + size, size))
        offset += size
    if not out:
        raise ValueError("Cannot create empty tensor bucket")
    return out


def bucket_nbytes(entries: Sequence[FlattenedTensorMetadata]) -> int:
    return entries[-1].end_idx if entries else 0


@dataclass
class Bucket:
    """A planned bucket: tensors in wire order and their byte layout."""

    metas: list[TensorMeta]
    entries: list[FlattenedTensorMetadata]

    @property
    def nbytes(self) -> int:
        return bucket_nbytes(self.entries)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]


def plan_buckets(metas: Iterable[TensorMeta], max_bytes: int) -> list[Bucket]:
    """Group tensors into buckets of at most `max_bytes` (a larger tensor goes alone).

    Parameter order is kept across buckets; inside a bucket tensors are ordered by
    descending itemsize so every offset satisfies the receiver's alignment rule.
    """
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {max_bytes}")
    groups: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for m in metas:
        if current and size + m.nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(m)
        size += m.nbytes
    if current:
        groups.append(current)
    buckets = []
    for group in groups:
        ordered = sorted(group, key=lambda m: -m.dtype.itemsize)  # stable
        buckets.append(Bucket(ordered, layout(ordered)))
    return buckets


def flatten_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Pack tensors (in wire order) into the uint8 buffer `out`; returns the used prefix."""
    flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
    total = sum(f.numel() for f in flat)
    dst = out[:total]
    torch.cat(flat, out=dst)
    return dst


def flatten(named_tensors: Sequence[tuple[str, torch.Tensor]]
            ) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """One new uint8 buffer for `named_tensors` plus its layout (sglang's byte layout)."""
    entries = layout([TensorMeta.of(n, t) for n, t in named_tensors])
    buf = torch.empty(bucket_nbytes(entries), dtype=torch.uint8,
                      device=named_tensors[0][1].device)
    flatten_into([t for _, t in named_tensors], buf)
    return buf, entries


def unflatten(buffer: torch.Tensor, entries: Sequence[FlattenedTensorMetadata]
              ) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors inside a flat uint8 buffer (no copy)."""
    if buffer.dtype != torch.uint8:
        raise ValueError(f"a flattened bucket must be uint8, got {buffer.dtype}")
    need = bucket_nbytes(entries)
    if buffer.numel() < need:
        raise ValueError(f"flattened bucket holds {buffer.numel()} bytes, layout needs {need}")
    return [(e.name, buffer[e.start_idx:e.end_idx].view(e.dtype).view(e.shape)) for e in entries]


class FlattenedTensorBucket:
    """A flat uint8 buffer and its layout; the counterpart of sglang's class of this name.

    Payloads from sglang-based trainers may carry this class (pickled under sglang's path);
    our unpickler maps it here, so the same attributes and accessors must exist.
    """

    supports_multi_dtypes = True

    def __init__(self, named_tensors: Sequence[tuple[str, torch.Tensor]] | None = None,
                 flattened_tensor: torch.Tensor | None = None,
                 metadata: list[FlattenedTensorMetadata] | None = None):
        if named_tensors is not None:
            self.flattened_tensor, self.metadata = flatten(list(named_tensors))
        elif flattened_tensor is None or metadata is None:
            raise ValueError("FlattenedTensorBucket needs named_tensors, or both "
                             "flattened_tensor and metadata")
        else:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return unflatten(self.flattened_tensor, self.metadata)
