"""Shared machinery of the transports: packing buckets, and waiting with a deadline.

Packing uses two rotating flat buffers: bucket k+1 is packed while bucket k is still in
use (on the wire, or being read by a colocated engine). On GPU packing runs on its own
CUDA stream, so it overlaps the NCCL broadcast of the previous bucket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_like.engine.handle import EngineHandle
from slime_like.errors import EngineError, WeightMetadataError, WeightSyncError
from slime_like.protocol.buckets import Bucket, TensorMeta
from slime_like.weights.fanout import CallCancelled, describe


@dataclass
class TransferStats:
    """Where the transfer's time went (seconds); filled by the transports."""

    bytes: int = 0
    buckets: int = 0
    pack_s: float = 0.0      # trainer-side packing (GPU: measured by CUDA events)
    wire_s: float | None = None  # broadcast busy time seen by the trainer (GPU events only)
    http_s: float = 0.0      # summed engine request latency (receive + load + HTTP)
    wait_s: float = 0.0      # host time blocked on buffers or engines
    prep_s: float = 0.0      # host time building requests (views, layouts, payloads, submits)
    first_call_s: float | None = None  # from the transfer's start to its first engine call
    started: float = field(default_factory=time.perf_counter, repr=False)
    per_engine_http_s: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_http(self, url: str, seconds: float) -> None:
        with self._lock:
            self.http_s += seconds
            self.per_engine_http_s[url] = self.per_engine_http_s.get(url, 0.0) + seconds

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "buckets": self.buckets, "pack_s": round(self.pack_s, 6),
                "wire_s": None if self.wire_s is None else round(self.wire_s, 6), "http_s": round(self.http_s, 6),
                "wait_s": round(self.wait_s, 6), "prep_s": round(self.prep_s, 6),
                "first_call_s": None if self.first_call_s is None else round(self.first_call_s, 6),
                "per_engine_http_s": {k: round(v, 6) for k, v in self.per_engine_http_s.items()}}


def bucket_tensors(stream: Iterator[tuple[str, torch.Tensor]], bucket: Bucket,
                   ) -> list[torch.Tensor]:
    """Pull the bucket's tensors from the source (parameter order) into layout order."""
    got: dict[str, torch.Tensor] = {}
    for _ in bucket.metas:
        try:
            name, tensor = next(stream)
        except StopIteration:
            raise WeightMetadataError(f"the weight source ended before {bucket.names[-1]!r}; "
                                      "it yields fewer tensors than its metadata lists") from None
        got[name] = tensor
    out = []
    for m in bucket.metas:
        t = got.get(m.name)
        if t is None:
            raise WeightMetadataError(f"the weight source yielded {sorted(got)} where its "
                                      f"metadata promised {m.name!r}: tensors out of order")
        if t.dtype != m.dtype or tuple(t.shape) != m.shape:
            raise WeightMetadataError(f"{m.name!r} is {t.dtype}{list(t.shape)} but its metadata "
                                      f"said {m.dtype}{list(m.shape)}")
        out.append(t)
    return out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a 1-D uint8 tensor (a view when contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


def direct_view(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The bucket's bytes without packing, when they already lie back to back in one storage.

    True of a one-tensor bucket, and of a trainer whose parameters live in flat buffers
    (Megatron-style) when the bucket follows their order: the bucket then goes out of the
    trainer's own storage, with no copy. Returns None when a pack is needed.
    """
    first = tensors[0]
    if first.device != device or not first.is_contiguous():
        return None
    if len(tensors) == 1:
        return flat_bytes(first)
    storage = first.untyped_storage()
    base = storage.data_ptr()
    start = first.data_ptr()
    end = start + first.numel() * first.element_size()
    for t in tensors[1:]:
        if t.data_ptr() != end or not t.is_contiguous() or t.untyped_storage().data_ptr() != base:
            return None
        end += t.numel() * t.element_size()
    whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    return whole[start - base:end - base]


@dataclass
class SendGroup:
    """One update request's worth of tensors: a planned bucket, or direct buckets merged."""

    metas: list[TensorMeta]
    tensors: list[torch.Tensor]
    nbytes: int
    #: the group's bytes in the trainer's own storage (no pack), or None
    view: torch.Tensor | None
    buckets: int = 1

    def joins(self, view: torch.Tensor | None, metas: Sequence[TensorMeta]) -> bool:
        """Whether a direct bucket (`view`, `metas`) continues this one's bytes exactly."""
        if self.view is None or view is None:
            return False
        if view.untyped_storage().data_ptr() != self.view.untyped_storage().data_ptr():
            return False
        if view.data_ptr() != self.view.data_ptr() + self.nbytes:
            return False
        offset = self.nbytes  # sglang's alignment rule, for the offsets in the joined layout
        for m in metas:
            if offset % m.dtype.itemsize:
                return False
            offset += m.nbytes
        return True

    def join(self, view: torch.Tensor, metas: Sequence[TensorMeta],
             tensors: list[torch.Tensor], nbytes: int) -> None:
        storage = torch.empty(0, dtype=torch.uint8, device=view.device).set_(
            self.view.untyped_storage())
        start = self.view.data_ptr() - storage.data_ptr()
        self.view = storage[start:start + self.nbytes + nbytes]
        self.metas += metas
        self.tensors += tensors
        self.nbytes += nbytes
        self.buckets += 1


def send_groups(stream: Iterator[tuple[str, torch.Tensor]], buckets: Sequence[Bucket],
                device: torch.device, *, merge_direct: bool) -> Iterator[tuple[SendGroup, bool]]:
    """The buckets as update requests, each with whether it is the last one.

    With `merge_direct`, consecutive buckets whose tensors lie back to back in one storage
    (a trainer with flat parameter buffers) go as one request: the bucket size bounds the
    pack buffer, and a direct view needs none, so splitting it only adds round trips. At
    most one bucket is pulled from the source ahead of the group being sent.
    """
    pending: SendGroup | None = None
    for bucket in buckets:
        tensors = bucket_tensors(stream, bucket)
        view = direct_view(tensors, device) if merge_direct else None
        if pending is not None and pending.joins(view, bucket.metas):
            pending.join(view, bucket.metas, tensors, bucket.nbytes)
            continue
        if pending is not None:
            yield pending, False
        pending = SendGroup(list(bucket.metas), tensors, bucket.nbytes, view)
    if pending is not None:
        yield pending, True


class BucketPacker:
    """Rotating flat uint8 buffers on one device, reused across buckets and syncs."""

    def __init__(self, device: torch.device, capacity: int, slots: int = 2,
                 cpu_share: bool = False):
        self.device = torch.device(device)
        self.capacity = capacity
        self.cpu_share = cpu_share and self.device.type == "cpu"
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cpu_pack_s = 0.0

    @property
    def slots(self) -> int:
        return len(self._buffers)

    def reserve(self, nbytes: int, buckets: int | None = None) -> None:
        """Allocate the slots now (at attach), sized for the largest planned bucket; with
        `buckets` packed buckets per sync, no more slots than that (one bucket, one buffer)."""
        self.capacity = min(self.capacity, max(1, nbytes))
        for slot in range(min(self.slots, buckets or self.slots)):
            self._buffer(slot, self.capacity)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self.capacity), dtype=torch.uint8, device=self.device)
            if self.cpu_share:
                # Move into named shared memory once; later packs write into it in place.
                buf.untyped_storage()._share_filename_cpu_()
            self._buffers[slot] = buf
        return buf

    def begin(self) -> None:
        """Order packing after the trainer's pending work (e.g. its last optimizer step)."""
        self._events.clear()
        self.cpu_pack_s = 0.0
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def pack(self, slot: int, tensors: Sequence[torch.Tensor], nbytes: int) -> torch.Tensor:
        """Copy tensors (layout order) into slot's buffer; returns the used uint8 prefix."""
        dst = self._buffer(slot, nbytes)[:nbytes]
        flat = [flat_bytes(t) for t in tensors]
        if self.stream is None:
            start = time.perf_counter()
            _copy_into(dst, flat)
            self.cpu_pack_s += time.perf_counter() - start
            return dst
        with torch.cuda.stream(self.stream):
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            _copy_into(dst, flat)
            ev1.record()
            self._events.append((ev0, ev1))
        return dst

    def wait_packed(self) -> None:
        """Block until every pack issued so far has landed (for readers outside our streams)."""
        if self._events:
            self._events[-1][1].synchronize()

    def pack_seconds(self) -> float:
        """Total packing time of this sync (synchronizes the GPU events it reads)."""
        if self.stream is None:
            return self.cpu_pack_s
        return sum(a.elapsed_time(b) for a, b in self._events) / 1e3

    def finish(self) -> None:
        """Later work on the trainer's stream (which may change parameters) waits for packing."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self) -> None:
        self._buffers = [None] * len(self._buffers)


MEMCPY_MIN_AVG_BYTES = 1 << 20  # tensors this large on average: one memcpy each


def _copy_into(dst: torch.Tensor, flat: list[torch.Tensor]) -> None:
    """Many small tensors: one `cat` kernel. Large ones: a memcpy each, which runs at about
    twice a copy kernel's bandwidth on an H200 (2.1 against 1.1 TB/s, 15 GB dense7b pack)."""
    if all(f.device == dst.device for f in flat) and dst.numel() < MEMCPY_MIN_AVG_BYTES * len(flat):
        torch.cat(flat, out=dst)
        return
    offset = 0
    for f in flat:
        dst[offset:offset + f.numel()].copy_(f, non_blocking=True)
        offset += f.numel()


@dataclass
class EngineCall:
    """An HTTP call in flight to one engine, for one step of the transfer."""

    engine: EngineHandle
    step: str
    future: Future
    started: float = field(default_factory=time.monotonic)
    done_at: float | None = None
    timer: Any = None  # what measured the call's round trip, if anything

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._mark)

    def _mark(self, _: Future) -> None:
        self.done_at = time.monotonic()

    @property
    def error(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None


class Watch:
    """Waits that give up at a deadline, or as soon as any watched engine call fails.

    This is what keeps the trainer out of a collective its peers never joined: an engine
    that answers 400 before joining a broadcast fails its HTTP call, and the wait on the
    broadcast sees that at once instead of sitting out the group timeout.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.calls: list[EngineCall] = []

    def add(self, call: EngineCall) -> EngineCall:
        self.calls.append(call)
        return call

    def check(self) -> None:
        """Raise the engine call that failed first (naming engine and step)."""
        failed = [c for c in self.calls if c.error is not None]
        if failed:
            first = min(failed, key=lambda c: c.done_at or 0.0)
            raise call_error(first, first.error)
        self.calls = [c for c in self.calls if not c.future.done()]

    def wait(self, done: Callable[[], bool], what: str, poll_s: float = 2e-4) -> None:
        """Spin until done() (or an engine call fails, or the deadline passes)."""
        while not done():
            self.check()
            if time.monotonic() > self.deadline:
                slow = sorted({c.engine.url for c in self.calls if not c.future.done()})
                raise WeightSyncError(
                    what, f"not finished after {self.timeout_s:.0f}s"
                    + (f"; engines still busy: {', '.join(slow)}" if slow else ""),
                    slow[0] if slow else None)
            time.sleep(poll_s)

    def wait_calls(self, calls: Sequence[EngineCall]) -> list:
        """Results of engine calls, failing fast on the first error among all watched."""
        self.wait(lambda: all(c.future.done() for c in calls), calls[0].step if calls else "")
        self.check()
        return [c.future.result() for c in calls]

    def explain(self, exc: BaseException, grace_s: float = 5.0) -> WeightSyncError:
        """The error for a failed collective, naming the engine that most likely broke it.

        A peer that refused a bucket, or died, breaks the collective for everyone, so the
        other engines' receives fail too. Called after our end of the group is closed (so no
        engine is still blocked), it waits for the engines' answers and picks, in order: an
        engine that no longer answers, an engine whose refusal is not itself a broken
        connection, then the earliest failure.
        """
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(c.future.done() for c in self.calls):
            time.sleep(0.01)
        failed = sorted((c for c in self.calls if c.error is not None),
                        key=lambda c: (_blame_rank(c.error), c.done_at or 0.0))
        if not failed:
            if isinstance(exc, WeightSyncError):
                return exc
            err = WeightSyncError("broadcast", f"{type(exc).__name__}: {exc}")
        else:
            first = failed[0]
            also = "" if isinstance(exc, WeightSyncError) else (
                f" (the broadcast then failed: {type(exc).__name__}: {exc})")
            err = WeightSyncError(first.step, describe(first.error) + also, first.engine.url)
        err.__cause__ = exc
        return err


# What a receive reports when a *peer* broke the collective (not a cause, a consequence).
_COLLATERAL = ("pair.cc", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
               "NCCL error", "ncclRemoteError", "ncclSystemError")


def no_answer(exc: BaseException | None) -> bool:
    """An engine call that got no HTTP answer at all: the engine is gone, or its control
    loop is stuck (a refusal, by contrast, is an answer)."""
    return isinstance(exc, EngineError) and exc.status is None


def _blame_rank(exc: BaseException) -> int:
    if isinstance(exc, CallCancelled):
        return 3  # never sent: a consequence of the failure, not a cause
    if no_answer(exc):
        return 0  # no answer at all: the engine is gone
    if not any(marker in str(exc) for marker in _COLLATERAL):
        return 1  # a refusal of its own (unknown group, bad layout, closed session...)
    return 2


def call_error(call: EngineCall, exc: BaseException) -> WeightSyncError:
    if isinstance(exc, WeightSyncError):
        return exc
    err = WeightSyncError(call.step, describe(exc), call.engine.url)
    if no_answer(exc):
        err.unresponsive = [call.engine.url]  # no answer (gone, or its control loop is stuck)
    err.__cause__ = exc
    return err


def timed(fn: Callable, stats: TransferStats, url: str) -> Callable:
    """Wrap an engine call so its latency lands in the stats."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        if stats.first_call_s is None:
            stats.first_call_s = start - stats.started
        try:
            return fn(*args, **kwargs)
        finally:
            stats.add_http(url, time.perf_counter() - start)
    return run


def metas_body(metas: Sequence[TensorMeta]) -> dict:
    """names / dtypes / shapes as sglang's update requests spell them."""
    from slime_like.protocol.buckets import dtype_name

    return {"names": [m.name for m in metas], "dtypes": [dtype_name(m.dtype) for m in metas],
            "shapes": [list(m.shape) for m in metas]}


def is_refusal(exc: BaseException) -> bool:
    """An engine answered (4xx/5xx), as opposed to not answering at all."""
    return isinstance(exc, EngineError) and exc.status is not None
