"""What one TP rank is asked to do with its weights: small typed operations.

The engine sends every rank the same kind of message, sglang's io_struct style: a frozen
dataclass per operation, picklable through a rank's pipe, run by its type
(`WeightReceiver.run`), never a method name looked up with `getattr`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InitGroup:
    """Join weight group `group_name` as rank `rank_offset + tp_rank`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True)
class DestroyGroup:
    group_name: str


@dataclass(frozen=True)
class ReceiveDistributed:
    """Take part in the trainer's broadcast(s) of one update request, then load by name."""

    names: Sequence[str]
    dtypes: Sequence[str]
    shapes: Sequence[Sequence[int]]
    group_name: str
    load_format: str | None


@dataclass(frozen=True)
class LoadTensorPayload:
    """This rank's serialized tensors (one payload per TP rank); a flattened bucket's
    buffer stays open for `mapping` (`ipc_mappings.py`: load, session or kept)."""

    payload: str | bytes
    load_format: str | None
    mapping: str = "session"
    ready_event: str | None = None  # the sender's CUDA IPC event to wait for first


@dataclass(frozen=True)
class LoadFromDisk:
    model_path: str
    load_format: str | None


@dataclass(frozen=True)
class ReceiveDelta:
    """One delta bucket (`protocol.weight_delta`): receive its compressed bytes, apply it
    onto the base it names. `engine_version`: what the engine serves as it arrives."""

    names: Sequence[str]
    dtypes: Sequence[str]
    shapes: Sequence[Sequence[int]]
    group_name: str
    header: dict
    engine_version: str


@dataclass(frozen=True)
class LoadDeltaFromDisk:
    """A delta directory (manifest and bucket files), applied whole or not at all."""

    path: str
    engine_version: str


@dataclass(frozen=True)
class Checksums:
    skip_tensor_list: Sequence[str] | None = None


@dataclass(frozen=True)
class ReleaseWeights:
    """Drop the parameter storage (shapes kept; a CPU backup with weights backup on)."""


@dataclass(frozen=True)
class ResumeWeights:
    """Give the parameters storage again (their contents back from a backup, if kept)."""


@dataclass(frozen=True)
class EndSession:
    """The update session ended: close the mappings it did not ask to keep (answers how
    many stay open)."""


RankOp = (InitGroup | DestroyGroup | ReceiveDistributed | LoadTensorPayload | LoadFromDisk
          | Checksums | ReleaseWeights | ResumeWeights | EndSession | ReceiveDelta
          | LoadDeltaFromDisk)
