"""Delta weight updates, the trainer's half: the base every engine holds, and when to send less.

`--update-weight-mode delta` (slime's spelling; `--update-weight-delta` is the same) keeps,
in this process's host memory, the bytes of the last sync in bucket layout (one copy of
the served weights: 2 GiB for a 1B-parameter bf16 model, plus 8 MiB of frame buffer per
core and two) and
the engines that acknowledged it. A sync is then a delta, bucket by bucket the zstd of
`base XOR new` with the digests of base and result (`protocol/weight_delta.py`), when every
engine holds that base; otherwise it is full, and the base is rewritten from what it sent:

  - the first sync, or the bucket plan changed (other names, dtypes, shapes, bucket size);
  - an engine that does not advertise delta support (`weight_delta_formats` in its
    /server_info: sglang has none, so a real sglang engine always gets full weights);
  - an engine that did not acknowledge the last sync: new, recovered (the fleet `forget`s
    it), or one whose process changed (its /server_info `startup_time`);
  - the last sync failed anywhere (the transport's `failed`): what each engine holds is
    unknown;
  - every `full_every`-th sync (`--update-weight-delta-full-every`): a chain of deltas is
    checked bucket by bucket, and a full sync on a schedule bounds what one silent error
    could cost anyway.

An engine refuses a delta whose base is not what it holds (version or digest), so a wrong
guess here costs a failed sync, never wrong weights; `WeightSync` then syncs again in full.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from slime_like.engine.session import EngineSession
from slime_like.protocol import delta_codec
from slime_like.protocol import weight_delta as wd
from slime_like.protocol.buckets import Bucket
from slime_like.weights.packing import flat_bytes
from slime_like.weights.sync_config import DEFAULT_DELTA_FULL_EVERY

log = logging.getLogger(__name__)



def host_bytes(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """A bucket's tensors as one flat uint8 host array (the wire layout: no padding)."""
    if not tensors:
        return np.empty(0, dtype=np.uint8)
    # cat copies, even one tensor: the base must own its bytes, not alias the model's
    return torch.cat([flat_bytes(t.detach()) for t in tensors]).cpu().numpy()


def host_pieces(tensors: Sequence[torch.Tensor], chunk: int = wd.CHUNK_BYTES
                ) -> Iterator[np.ndarray]:
    """A bucket's bytes in wire layout as host pieces of at most `chunk` bytes: views of
    CPU tensors (no copy), one small fresh copy each from a GPU (the encoder reads them on
    its codec threads after they are given)."""
    for t in tensors:
        flat = flat_bytes(t.detach())
        for start in range(0, flat.numel(), chunk):
            yield flat[start:start + chunk].cpu().numpy()


@dataclass
class DeltaOutcome:
    """What the last sync sent: delta or full, why, and how many bytes against the bucket's."""

    mode: str
    reason: str
    raw_bytes: int = 0
    sent_bytes: int = 0

    def as_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "raw_bytes": self.raw_bytes,
                "sent_bytes": self.sent_bytes,
                "ratio": round(self.sent_bytes / self.raw_bytes, 6) if self.raw_bytes else None}


class DeltaBase:
    """The last synced bytes per bucket (host memory), their digests, and who holds them."""

    def __init__(self, full_every: int = DEFAULT_DELTA_FULL_EVERY):
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.full_every = full_every
        self.buckets: list[np.ndarray] = []
        self.checksums: list[str] = []
        self.signature: tuple | None = None
        self.version: str | None = None
        self.holders: dict[str, tuple] = {}
        self.since_full = 0
        self._buffers: list[np.ndarray] = []  # the encoder's frame buffers, kept across buckets
        self.outcome: DeltaOutcome | None = None

    @property
    def nbytes(self) -> int:
        """Host memory the base holds."""
        return sum(b.nbytes for b in self.buckets) + sum(b.nbytes for b in self._buffers)

    # ---- the choice ------------------------------------------------------------------------

    def full_reason(self, engines: Sequence[EngineSession], buckets: Sequence[Bucket]) -> str | None:
        """Why this sync must be full, or None: every engine holds the base, send a delta."""
        if self.version is None or len(self.buckets) != len(buckets):
            return "no base yet"
        if self.signature != _signature(buckets):
            return "the bucket plan changed"
        unsupported = [e.url for e in engines if not wd.supports_delta(e.server_info)]
        if unsupported:
            return (f"engine(s) {unsupported} do not advertise {wd.XOR_ZSTD!r} in /server_info "
                    f"{wd.SERVER_INFO_KEY!r} (sglang applies full weights only)")
        missing = [e.url for e in engines if self.holders.get(e.url) != identity(e)]
        if missing:
            return f"engine(s) {missing} do not hold version {self.version!r} (new or recovered)"
        if self.since_full + 1 >= self.full_every:
            return f"every {self.full_every}th sync is full"
        return None

    # ---- one sync --------------------------------------------------------------------------

    def start(self, buckets: Sequence[Bucket], reason: str | None) -> None:
        """Begin a sync: a full one forgets the old base (it is rewritten bucket by bucket)."""
        self.outcome = DeltaOutcome("full" if reason else "delta", reason or "")
        if reason:
            self.buckets, self.checksums = [None] * len(buckets), [""] * len(buckets)  # type: ignore[list-item]
            self.signature, self.version, self.holders = _signature(buckets), None, {}
        self._base_version = self.version

    def record(self, k: int, new: np.ndarray) -> None:
        """A full sync's bucket k becomes the base."""
        self.buckets[k] = new
        self.checksums[k] = wd.bucket_digest(new)
        self.outcome.raw_bytes += new.nbytes
        self.outcome.sent_bytes += new.nbytes

    def encode(self, k: int, pieces: Iterable[np.ndarray], sink: BinaryIO) -> wd.DeltaHeader:
        """Bucket k, given as flat-layout pieces (`host_pieces`), as a delta on the base,
        streamed into `sink`; the base becomes the new bytes in place. A failure midway
        leaves that bucket half new: the base is then forgotten (the next sync is full)."""
        base = self.buckets[k]
        encoder = delta_codec.DeltaEncoder(base, sink, self._buffers)
        try:
            for piece in pieces:
                encoder.write(piece)
            checksum, frames = encoder.finish()
        except BaseException:
            encoder.close()
            self.release()  # half new: no engine holds these bytes
            raise
        encoded = sum(frames)
        header = wd.DeltaHeader(base_version=self._base_version, base_checksum=self.checksums[k],
                                checksum=checksum, encoded_nbytes=encoded, nbytes=base.nbytes,
                                frames=frames)
        self.checksums[k] = checksum
        self.outcome.raw_bytes += base.nbytes
        self.outcome.sent_bytes += encoded
        return header

    def landed(self, engines: Sequence[EngineSession], version: str) -> None:
        """Every byte of the sync is on its way: these engines will hold `version` (unless
        the sync fails after all, which `invalidate`s)."""
        full = self.outcome is not None and self.outcome.mode == "full"
        self.since_full = 0 if full else self.since_full + 1
        self.version = version
        self.holders = {e.url: identity(e) for e in engines}
        if self.outcome is not None:
            log.info("weight sync %s: %s (%s), %d of %d bytes sent", version, self.outcome.mode,
                     self.outcome.reason or "every engine holds the base",
                     self.outcome.sent_bytes, self.outcome.raw_bytes)

    def invalidate(self) -> None:
        """The last sync failed: no engine is known to hold the base; the next is full."""
        self.version, self.holders = None, {}

    def forget(self, urls: Sequence[str]) -> None:
        for url in urls:
            self.holders.pop(url, None)

    def release(self) -> None:
        self.buckets, self.checksums, self._buffers = [], [], []
        self.signature, self.version, self.holders = None, None, {}


def identity(engine: EngineSession) -> tuple:
    """What tells two processes at one URL apart: the engine id and its start time."""
    return (engine.address.engine_id, engine.server_info.get("startup_time"))


def _signature(buckets: Sequence[Bucket]) -> tuple:
    return tuple(tuple(b.metas) for b in buckets)
