"""A weight source over FSDP2-sharded weights: every rank takes part, rank 0 sends.

`ShardedWeights` wraps the DTensor parameters of a `fully_shard` model (or a DTensor state
dict). Its metadata are the full tensors' (names, dtypes, global shapes), so `WeightSync`
plans, checks and transfers exactly as for a full replica. Rank 0 of the shards' group is
the one that syncs: when a transport pulls `tensors()`, a helper thread gathers the
shards bucket by bucket (the same plan as the transport's, `plan_buckets`) straight into
one of two flat buffers laid out as the bucket is on the wire, so the `distributed`
transport broadcasts the buffer as it is (`direct_view`, no pack). Bucket k+1 is gathered
while bucket k is broadcast; a buffer is gathered into again only after the transport
reported its broadcast done (`bucket_sent`). Every other rank runs `serve()`: it follows
rank 0's commands (start, gather bucket k, end) on the shards' group and sends its rows.

Memory: a rank holds its shard (and, casting, one bucket's rows in the engines' dtype
while they are sent); rank 0 holds two bucket buffers besides. Rows go point to point into
their place in the buffer, so nothing is staged or padded on the way. With `copies=True`
(the `tensor` and `disk` transports, which
keep tensors past the next pull) rank 0 yields copies of each gathered tensor instead.

Failure: a rank that dies mid-gather makes rank 0's gather fail; the transport's next pull
raises it as a `WeightSyncError` naming the bucket, and `WeightSync`'s transaction cleans up
as for any failed transfer. `finish()` (always called by the syncing rank) stops the
helper and releases the other ranks from `serve()`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slime_like.errors import WeightMetadataError, WeightSyncError
from slime_like.protocol.buckets import Bucket, TensorMeta, plan_buckets

_END, _START, _GATHER, _DONE = 0, 1, 2, 3


def is_sharded(weights: Any) -> bool:
    """Whether `weights` (a module or a state dict) holds DTensors (FSDP2 and the like)."""
    from torch.distributed.tensor import DTensor

    if isinstance(weights, nn.Module):
        return any(isinstance(p, DTensor) for p in weights.parameters())
    if isinstance(weights, Mapping):
        return any(isinstance(t, DTensor) for t in weights.values())
    return False


@dataclass
class _Entry:
    """One tensor: its local rows and how the full tensor is split over the group."""

    name: str
    local: torch.Tensor
    shape: tuple[int, ...]
    sharded: bool  # Shard(0) over the group; otherwise every rank holds it whole

    def chunk_rows(self, world: int) -> int:
        return -(-self.shape[0] // world) if self.sharded else self.shape[0]


@dataclass
class GatherStats:
    """What the last sync's gathers cost on the syncing rank (seconds, bytes)."""

    gather_s: float = 0.0   # time the helper spent in gathers
    wait_s: float = 0.0     # time the transport waited for a bucket's gather
    buckets: int = 0
    buffer_bytes: int = 0   # the two bucket buffers together
    gathers: list[tuple[float, float]] = field(default_factory=list)  # (start, end) per bucket
    sends: list[tuple[float, float]] = field(default_factory=list)    # broadcast in flight

    @property
    def overlap(self) -> float | None:
        """The share of the gather time during which a broadcast was in flight (the gather
        hidden behind it); None when the transport did not report its sends."""
        total = sum(end - start for start, end in self.gathers)
        if not self.sends or total <= 0:
            return None
        hidden = sum(max(0.0, min(ge, se) - max(gs, ss))
                     for gs, ge in self.gathers for ss, se in self.sends)
        return min(1.0, hidden / total)

    def as_dict(self) -> dict:
        return {"gather_s": round(self.gather_s, 6), "gather_wait_s": round(self.wait_s, 6),
                "overlap": None if self.overlap is None else round(self.overlap, 4),
                "buckets": self.buckets,
                "buffer_bytes": self.buffer_bytes}


class ShardedWeights:
    """Full tensors gathered from DTensor shards, bucket by bucket; collective on `group`.

    `weights`: an FSDP2 module (HF parameter names, a tied lm_head left out) or a state
    dict of DTensors (plain tensors in it are taken as replicated). `dtype` casts floating
    tensors (the engines' dtype) before they are gathered. `bucket_bytes` must be the
    sync's `update_weight_buffer_size`, so the gathered buckets are the transport's.
    """

    def __init__(self, weights: nn.Module | Mapping[str, torch.Tensor] | Iterable, *,
                 bucket_bytes: int, dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None, copies: bool = False):
        self._module = weights if isinstance(weights, nn.Module) else None
        self.entries = self._read(weights)
        if not self.entries:
            raise WeightMetadataError("nothing to sync: the sharded weights have no tensors")
        self.group = group if group is not None else _group_of(weights)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.dtype = dtype
        self.bucket_bytes = int(bucket_bytes)
        self.copies = copies
        # Rank 0's buffers are the wire's buckets: the transport reserves no pack buffers.
        self.buckets_in_wire_layout = not copies
        self.device = self.entries[0].local.device
        self._metas = [TensorMeta(e.name, self._cast(e.local.dtype), e.shape) for e in self.entries]
        self._by_name = {e.name: e for e in self.entries}
        self.stats = GatherStats()
        self._buffers: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None
        self._session = False

    def _read(self, weights: Any) -> list[_Entry]:
        if isinstance(weights, nn.Module):
            reshard(weights)
        return [self._entry(n, t) for n, t in _named(weights)]

    def _refresh(self) -> None:
        """A module's parameters as they are now: FSDP swaps a unit's registered parameters
        while it is unsharded (e.g. the root after a forward without backward)."""
        if self._module is None:
            return
        entries = self._read(self._module)
        if [(e.name, e.shape, e.sharded) for e in entries] != \
                [(e.name, e.shape, e.sharded) for e in self.entries]:
            raise WeightMetadataError("the sharded model's parameters changed since the "
                                      "source was made (names, shapes or placements)")
        self.entries = entries
        self._by_name = {e.name: e for e in entries}

    def _entry(self, name: str, tensor: torch.Tensor) -> _Entry:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        t = tensor.detach()
        if not isinstance(t, DTensor):
            return _Entry(name, t, tuple(t.shape), False)
        placements = tuple(t.placements)
        if placements == (Shard(0),) and t.dim() > 0:
            return _Entry(name, t.to_local(), tuple(t.shape), True)
        if placements == (Replicate(),):
            return _Entry(name, t.to_local(), tuple(t.shape), False)
        raise WeightMetadataError(f"{name!r} is a DTensor placed as {list(placements)} on a "
                                  f"{t.device_mesh.ndim}-D mesh; a sync gathers only "
                                  "Shard(0) or Replicate over one mesh dimension (FSDP2)")

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    # ---- WeightSource ------------------------------------------------------------------------

    def metadata(self) -> list[TensorMeta]:
        return self._metas

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: the full tensors, bucket by bucket, while the next bucket is gathered."""
        if self.rank != 0:
            raise WeightSyncError("transfer", f"rank {self.rank} of the trainer's group does "
                                  "not send; it takes part through serve()")
        self._stop_helper()
        self._refresh()
        buckets = plan_buckets(self._metas, self.bucket_bytes)
        self._reserve(buckets)
        self.stats = GatherStats(buffer_bytes=sum(b.numel() for b in self._buffers))
        ready: queue.Queue = queue.Queue()
        self._released = [threading.Event() for _ in buckets]
        self._works: list[Sequence[Any]] = [() for _ in buckets]
        self._abort = threading.Event()
        self._sent: queue.Queue = queue.Queue()
        threading.Thread(target=self._time_sends, args=(self._sent, self.stats, len(buckets),
                                                          self.device.type == "cuda"),
                         name="shard-send-clock", daemon=True).start()
        self._thread = threading.Thread(target=self._gather_all, args=(buckets, ready),
                                        name="shard-gather", daemon=True)
        self._session = True
        self._thread.start()
        for k, bucket in enumerate(buckets):
            t0 = time.perf_counter()
            got = ready.get()
            self.stats.wait_s += time.perf_counter() - t0
            if isinstance(got, BaseException):
                raise WeightSyncError("transfer", f"gathering bucket {k + 1}/{len(buckets)} "
                                      f"({bucket.names[0]!r}...) from the trainer's "
                                      f"{self.world} ranks failed: {type(got).__name__}: "
                                      f"{got}") from got
            views = self._views(self._buffers[k % 2], bucket)
            if self.copies:
                views = [(n, t.clone()) for n, t in views]
                self._released[k].set()
            yield from views

    def bucket_sent(self, index: int, works: Sequence[Any]) -> None:
        """The transport's word that bucket `index` is on its way: its buffer is free once
        `works` (the broadcasts reading it) are done."""
        if self._session and index < len(self._released):
            self._works[index] = tuple(works)
            self._released[index].set()
            self._sent.put((time.perf_counter(), tuple(works)))

    @staticmethod
    def _time_sends(sent: queue.Queue, stats: GatherStats, count: int, cuda: bool) -> None:
        """When each bucket's broadcast ended (for the overlap figure only)."""
        for _ in range(count):
            got = sent.get()
            if got is None:  # the sync ended
                return
            start, works = got
            for work in works:
                with contextlib.suppress(Exception):  # the transport reports failures
                    if cuda:  # wait() would only order streams: poll the GPU's progress
                        while not work.is_completed():
                            time.sleep(0.0005)
                    else:
                        work.wait()  # gloo: blocks without the GIL
            stats.sends.append((start, time.perf_counter()))

    def finish(self) -> None:
        """Rank 0, after every sync (done or failed): stop gathering, release the others."""
        if self.rank != 0:
            return
        self._stop_helper()
        sent = getattr(self, "_sent", None)
        if sent is not None:
            sent.put(None)
        if self._session or self._thread is None:
            with contextlib.suppress(Exception):  # a dead peer: the group is gone anyway
                self._command(_END)
        self._session = False
        self._thread = None

    # ---- the other ranks -------------------------------------------------------------------

    def done(self) -> None:
        """Rank 0, after the last sync of a push with retries: the others' `serve(
        until_done=True)` returns."""
        if self.rank == 0:
            with contextlib.suppress(Exception):  # a dead peer: the group is gone anyway
                self._command(_DONE)

    def serve(self, until_done: bool = False) -> int:
        """Ranks other than 0: send this rank's rows for each bucket rank 0 asks, until it
        ends the sync (with `until_done`: every sync until rank 0's `done()`, one per
        attempt of a push with retries). Returns the number of buckets served."""
        if self.rank == 0:
            raise WeightSyncError("transfer", "rank 0 syncs (WeightSync.update); serve() is "
                                  "for the other ranks")
        self._refresh()
        buckets: list[Bucket] = []
        served = 0
        while True:
            cmd, arg = self._receive_command()
            if cmd == _DONE or (cmd == _END and not until_done):
                return served
            if cmd == _START:
                buckets = plan_buckets(self._metas, arg)
            elif cmd == _GATHER:
                self._gather_bucket(buckets[arg], None)
                served += 1

    # ---- gathering -------------------------------------------------------------------------

    def _stop_helper(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._abort.set()
            for event in self._released:
                event.set()
            thread.join()

    def _reserve(self, buckets: list[Bucket]) -> None:
        need = max(b.nbytes for b in buckets)
        slots = min(2, len(buckets))
        if len(self._buffers) != slots or self._buffers[0].numel() < need:
            self._buffers = []  # the old ones go first
            self._buffers = [torch.empty(need, dtype=torch.uint8, device=self.device)
                             for _ in range(slots)]

    def _gather_all(self, buckets: list[Bucket], ready: queue.Queue) -> None:
        try:
            self._command(_START, self.bucket_bytes)
            for k, bucket in enumerate(buckets):
                if k >= 2:
                    self._released[k - 2].wait()
                    for work in self._works[k - 2]:
                        with contextlib.suppress(Exception):  # the transport reports its own
                            work.wait()
                if self._abort.is_set():
                    return
                t0 = time.perf_counter()
                self._command(_GATHER, k)
                self._gather_bucket(bucket, self._buffers[k % 2])
                if self.device.type == "cuda":  # the transport reads it on its own stream
                    torch.cuda.current_stream(self.device).synchronize()
                t1 = time.perf_counter()
                self.stats.gather_s += t1 - t0
                self.stats.gathers.append((t0, t1))
                self.stats.buckets += 1
                ready.put(k)
        except BaseException as e:  # noqa: BLE001 - handed to the pulling thread
            self._session = False  # a broken group gets no END
            ready.put(e)

    def _gather_bucket(self, bucket: Bucket, out: torch.Tensor | None) -> None:
        """Every rank: each tensor's rows straight into rank 0's buffer at the bucket's layout
        offset (point to point: no padding, no staging copy), one bucket's ops in flight."""
        ops, keep = [], []
        for tag, entry in enumerate(bucket.entries):
            e = self._by_name[entry.name]
            dtype = self._cast(e.local.dtype)
            if out is None:
                if e.sharded and e.local.shape[0]:
                    rows = e.local.to(dtype).contiguous()
                    keep.append(rows)
                    ops.append(dist.isend(rows, group=self.group, group_dst=0, tag=tag))
                continue
            full = _typed(out, entry.start_idx, dtype, e.shape)
            if not e.sharded:
                full.copy_(e.local)
                continue
            chunk = e.chunk_rows(self.world)
            for r in range(self.world):
                lo, hi = r * chunk, min(e.shape[0], (r + 1) * chunk)
                if hi <= lo:
                    continue
                if r == 0:
                    full[lo:hi].copy_(e.local)
                else:
                    ops.append(dist.irecv(full[lo:hi], group=self.group, group_src=r, tag=tag))
        for op in ops:
            op.wait()

    def _views(self, buf: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        return [(entry.name, _typed(buf, entry.start_idx, entry.dtype, entry.shape))
                for entry in bucket.entries]

    def _command(self, cmd: int, arg: int = 0) -> None:
        msg = torch.tensor([cmd, arg], dtype=torch.int64, device=self.device)
        dist.broadcast(msg, group=self.group, group_src=0)

    def _receive_command(self) -> tuple[int, int]:
        msg = torch.zeros(2, dtype=torch.int64, device=self.device)
        dist.broadcast(msg, group=self.group, group_src=0)
        return int(msg[0]), int(msg[1])


def reshard(module: nn.Module) -> None:
    """Every FSDP2 unit of `module` back to its sharded parameters (local, no collective)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _typed(buf: torch.Tensor, start: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return buf[start:start + n * dtype.itemsize].view(dtype).view(tuple(shape))


def _named(weights: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(weights, nn.Module):
        from slime_like.models.transformer import hf_named_parameters

        return list(hf_named_parameters(weights))
    if isinstance(weights, Mapping):
        return list(weights.items())
    return list(weights)


def _group_of(weights: Any) -> dist.ProcessGroup:
    from torch.distributed.tensor import DTensor

    for _, t in _named(weights):
        if isinstance(t, DTensor):
            return t.device_mesh.get_group()
    return dist.group.WORLD
