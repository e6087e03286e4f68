"""The `distributed` transport: one weight group over every engine, broadcast from rank 0.

Layout (sglang's): trainer rank 0, engine i's TP ranks at `1 + sum(earlier tp) + tp_rank`,
`world_size = 1 + sum(tp)`. Each group gets a name unique to the attempt; every name an
engine was asked to join is remembered and destroyed on re-attach, so a rebuilt group
(after a dead peer was dropped, or an engine came back) never collides with a stale one.

Per bucket, a payload: the `update_weights_from_distributed` request (`flattened_bucket`)
the sync posts through every engine's session, each engine's posts strictly in order; then
the flat buffer is broadcast. Bucket k+1 is packed
while bucket k is on the wire; on GPU packing runs on its own stream and the broadcast
waits for it by stream order, so the host never blocks between buckets.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from slime_like.engine.fanout import on_all_steps, start_steps
from slime_like.engine.session import EngineSession
from slime_like.errors import WeightSyncError
from slime_like.protocol import io_struct as p
from slime_like.protocol.buckets import Bucket
from slime_like.protocol.socket_ifname import InterfaceError, check_reachable
from slime_like.protocol.weight_group import (
    abort_process_group,
    destroy_process_group,
    free_in_background,
    host_store,
    init_custom_process_group,
    join_store,
)
from slime_like.weights.group_setup import (
    JOIN,
    PENDING_JOINS,
    UNANSWERED_GRACE_S,
    backend_hint,
    close_group,
    engine_ranks,
    host_port,
    join_pending,
    master_address_for,
    nccl_env_hint,
    never_answered,
    not_joined,
    wait_for_group,
)
from slime_like.weights.packing import (
    BucketPacker,
    WeightSource,
    bucket_tensors,
    direct_view,
    metas_body,
)
from slime_like.weights.transport import Payload, TransferStats, Transport
from slime_like.weights.watch import EngineCall, Watch

log = logging.getLogger(__name__)

FLATTENED = p.FLATTENED_BUCKET
PER_TENSOR = "per_tensor"


class DistributedTransport(Transport):
    """torch.distributed broadcast into every engine (NCCL on GPU, gloo on CPU)."""

    name = "distributed"

    def __init__(self, *, device: torch.device | str = "cpu", bucket_bytes: int,
                 load_format: str = FLATTENED, backend: str | None = None,
                 master_address: str | None = None, master_port: int | None = None,
                 group_timeout_s: float = 300.0):
        if load_format not in (FLATTENED, PER_TENSOR):
            raise ValueError(f"load_format must be {FLATTENED!r} or {PER_TENSOR!r}, "
                             f"got {load_format!r}")
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "nccl":
            # NVLink multicast (NVLS) stays off, as sglang's own trainer-side test has it;
            # cuMem must agree with sglang's engines, which force it off. P2P/SHM stay on.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
            if nccl_env_hint():
                log.warning("%s", nccl_env_hint())
        self.load_format = load_format
        self.master_address = master_address
        self.master_port = master_port
        self.group_timeout_s = group_timeout_s
        self.packer = BucketPacker(self.device, bucket_bytes)
        self._closing: threading.Thread | None = None  # a failed group, closing
        self._freeing: list[threading.Thread] = []  # replaced groups, being freed
        self.pg: dist.ProcessGroup | None = None
        self.group_name: str | None = None
        self.members: tuple[tuple[str, int], ...] = ()
        # Every session asked to join a group of ours: each remembers the names it joined,
        # and leaves them all at a regroup or a close.
        self.asked: dict[str, EngineSession] = {}
        self.dirty = False
        self.attempt = 0
        self._warned_per_tensor = False
        self._timing_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- the group ---------------------------------------------------------------------------

    def attach(self, engines: Sequence[EngineSession]) -> None:
        members = tuple((e.url, e.tp_size) for e in engines)
        if self.pg is not None and members == self.members:
            return
        # Engines outside the new group leave their old groups without being waited for:
        # one dropped as hung would hold the regroup for its whole leave timeout.
        self._teardown(aside=[url for url in self.asked if url not in {u for u, _ in members}])
        self._create(engines)

    def forget(self, urls: Sequence[str]) -> None:
        if any(url in urls for url, _ in self.members):
            self.members = ()  # the next attach regroups, whoever comes back

    def prepare(self, buckets) -> None:
        packed = [b.nbytes for b in buckets if len(b.metas) > 1]
        if packed:
            self.packer.reserve(max(packed), len(packed))

    def _create(self, engines: Sequence[EngineSession]) -> None:
        busy = sorted(e.url for e in engines if join_pending(e.url))
        if busy:  # another join would only queue behind it, on the same stuck control loop
            err = WeightSyncError("init_weights_update_group", "an earlier join is still "
                                  f"unanswered by: {', '.join(busy)}", busy[0])
            err.unresponsive = busy
            raise err
        self.attempt += 1
        name = f"slime_like_weights_{os.getpid()}_{uuid.uuid4().hex[:8]}_{self.attempt}"
        offsets, world_size = engine_ranks(engines)
        address = self.master_address or master_address_for(engines)
        step = JOIN
        try:  # a wrong interface fails here in seconds, not in the rendezvous after minutes
            choice = check_reachable(self.backend, [host_port(e.url) for e in engines],
                                     who="the trainer (rank 0)")
        except InterfaceError as e:
            raise WeightSyncError(step, str(e)) from None
        if choice is not None:
            log.info("weight group %s: rank 0 binds %s; every engine reached from it", name,
                     choice.describe())
        # Held only here (and by the group once it exists): a failed attempt must close the
        # store, or engines still in its rendezvous wait out their own timeout (600 s in the
        # reference engine, longer in sglang) and take no other control call meanwhile.
        held = {"store": host_store(world_size, self.group_timeout_s,
                                    port=self.master_port or 0, host=address)}
        port = held["store"].port
        # Rank 0 joins as a client: were it to hold the master, an engine that fails at
        # once (killed as it was asked to join) would leave the others in the rendezvous
        # until rank 0's own join timed out.
        joiner = join_store(address, port, world_size, self.group_timeout_s)
        watch = Watch(self.group_timeout_s + 10, self.clock, per_call=False)
        http = []
        for engine, offset in zip(engines, offsets, strict=True):
            req = p.InitWeightsUpdateGroupRequest(
                master_address=address, master_port=port, rank_offset=offset,
                world_size=world_size, group_name=name, backend=self.backend)
            self.asked[engine.url] = engine
            engine.new_chain()  # a join that failed in an earlier attempt does not stop this one
            future = engine.submit_steps(engine.join_steps, req, self.group_timeout_s + 5)
            PENDING_JOINS[engine.url] = future
            http.append(watch.add(EngineCall(engine, step, future)))
        result: dict = {}

        def rank0() -> None:
            try:
                result["pg"] = init_custom_process_group(
                    backend=self.backend, store=joiner, world_size=world_size, rank=0,
                    group_name=name, timeout=self.group_timeout_s)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                e.__traceback__ = None  # its frames would keep the store open
                result["error"] = e

        # Rank 0 joins from a helper thread so an engine that refuses the group (its HTTP
        # call fails) stops the wait at once instead of after the rendezvous timeout.
        thread = threading.Thread(target=rank0, name="weight-group-rank0", daemon=True)
        thread.start()
        try:
            wait_for_group(watch, lambda: not thread.is_alive(), http, self.clock)
            if "error" in result:
                err = result.pop("error")
                watch.check()  # an engine's own answer explains more than the rendezvous error
                raise WeightSyncError(step, f"rank 0 could not join group {name!r} "
                                      f"({world_size} ranks): {err}{backend_hint(self.backend)}")
            watch.wait_calls(http)
            for call in http if self.clock is not None else ():
                self.clock.record_answer(JOIN, call.future)
        except BaseException as exc:
            held.clear()  # closes the store: every rank still in the rendezvous fails at once
            if "pg" in result:
                destroy_process_group(result.pop("pg"))
            gc.collect()
            if isinstance(exc, WeightSyncError) and exc.step == step and exc.engine is None:
                stuck = never_answered(http, UNANSWERED_GRACE_S)
                if stuck:
                    raise not_joined(exc, stuck) from exc
            raise
        self.pg, self.group_name, self._store = result["pg"], name, held.pop("store")
        self.members = tuple((e.url, e.tp_size) for e in engines)
        self.dirty = False
        log.info("weight group %s: %d ranks over %d engines (%s)", name, world_size,
                 len(engines), self.backend)

    def _teardown(self, leave_timeout_s: float = 10.0, only: Sequence[str] | None = None,
                  aside: Sequence[str] = ()) -> None:
        """Drop our side of the current group and ask engines to destroy every group they
        joined (those of `aside` on the engine pool, not waited for; a name not left stays
        for the next teardown)."""
        if self.pg is not None:
            # Out of torch's registry here (fast); freed on a thread, while the engines
            # leave: the close takes about 10 ms a peer (weight_group.free_group).
            destroy_process_group(self.pg)
            held, self.pg = [self.pg], None
            freeing = free_in_background(held)
            del held  # the thread's list is the last reference: it empties it
            self._freeing = [t for t in self._freeing if t.is_alive()] + [freeing]
        self.pg, self.group_name, self.members, self._store = None, None, (), None
        # The sessions that joined (keys and all: the destroy is an admin call) leave every
        # group they joined; one that cannot reach its engine keeps the names, and leaves
        # them at the next regroup if the engine is back by then.
        sessions = [s for s in self.asked.values() if s.groups]
        self.asked = {s.url: s for s in sessions}
        leaving = [s for s in sessions if only is None or s.url in only]
        start_steps([s for s in leaving if s.url in aside],
                    lambda s: s.leave_steps(leave_timeout_s))
        with contextlib.suppress(WeightSyncError):
            on_all_steps([s for s in leaving if s.url not in aside],
                         "destroy_weights_update_group", lambda s: s.leave_steps(leave_timeout_s))
        self.asked = {s.url: s for s in sessions if s.groups}
        self._closed()  # a failed group closes once its engines left it

    def failed(self) -> None:
        """Drop our end of the group: engines blocked receiving from us fail instead of hanging.

        Closing rank 0's connections is what releases them (a gloo receive otherwise waits
        out the group timeout); the next sync builds a fresh group.
        """
        self.dirty = True
        pg, self.pg, self._store = self.pg, None, None
        if pg is not None:
            abort_process_group(pg)
            # gloo cannot abort: its destroy waits for every pending send, and a send to a
            # live engine that never joined (it refused the update, or was never asked)
            # waits until that engine leaves the group, which `abandon` asks it to do next.
            # So the group closes on a thread of its own; the next group waits for it.
            # Handed over in a list the close empties: the thread's own arguments would
            # otherwise keep the group alive until it ends.
            self._closing = threading.Thread(target=close_group, args=([pg],), daemon=True,
                                             name="weight-group-close")
            del pg
            self._closing.start()

    def _closed(self) -> None:
        """Wait (bounded by the group timeout) until a failed group has closed."""
        closing, self._closing = self._closing, None
        if closing is not None:
            closing.join(self.group_timeout_s)

    def abandon(self, answering: Sequence[str]) -> None:
        """Every engine leaves the failed sync's group now, not at the next regroup: a group
        no sync will use again must not outlive the failure (on GPUs, an NCCL communicator).
        A short wait each: an engine that does not answer is the fleet's to recover."""
        closing, self._closing = self._closing, None  # the engines leave first: that ends
        self._teardown(leave_timeout_s=3.0, only=answering)  # a send the close waits on
        self._closing = closing

    def close(self, engines: Sequence[EngineSession]) -> None:
        self._teardown()
        for thread in self._freeing:  # nothing of ours outlives the close
            thread.join(self.group_timeout_s)
        self._freeing = []
        self.packer.release()

    # ---- the payloads ------------------------------------------------------------------------

    def payloads(self, engines: Sequence[EngineSession], source: WeightSource,
                 buckets: Sequence[Bucket], version: str, watch: Watch, stats: TransferStats
                 ) -> Iterator[Payload]:
        if self.pg is None or self.members != tuple((e.url, e.tp_size) for e in engines):
            raise WeightSyncError("transfer", "the weight group does not match the engines; "
                                  "attach before transferring")
        flattened = self.load_format == FLATTENED
        old = [e.url for e in engines if not e.has_flattened_distributed]
        if flattened and old:
            if not self._warned_per_tensor:
                log.warning("engines %s predate flattened_bucket over distributed updates "
                            "(sglang < 0.5.9); sending one broadcast per tensor", old)
                self._warned_per_tensor = True
            flattened = False
        send = self._flattened if flattened else self._per_tensor
        yield from send(source, buckets, watch, stats)

    def explain(self, err: WeightSyncError) -> WeightSyncError:
        hint = backend_hint(self.backend)
        if hint and hint not in str(err.args[0] if err.args else ""):
            err.args = (f"{err.args[0] if err.args else err}{hint}",)
        return err

    def _broadcast(self, buf: torch.Tensor, stream: torch.cuda.Stream | None):
        if stream is None:
            return dist.broadcast(buf, src=0, group=self.pg, async_op=True)
        with torch.cuda.stream(stream):  # NCCL waits for what is queued on this stream
            return dist.broadcast(buf, src=0, group=self.pg, async_op=True)

    def _payload(self, k: int, count: int, metas, load_format: str | None) -> Payload:
        body, group = metas_body(metas), self.group_name

        def request(engine: EngineSession, flush: bool, version: str | None):
            return p.UpdateWeightsFromDistributedRequest(
                **body, group_name=group, flush_cache=flush, weight_version=version,
                load_format=load_format)

        return Payload(f"update_weights_from_distributed (bucket {k + 1}/{count})",
                       "update_weights_from_distributed", request,
                       sum(m.nbytes for m in metas), last=k == count - 1)

    def _flattened(self, source: WeightSource, buckets: Sequence[Bucket], watch: Watch,
                   stats: TransferStats) -> Iterator[Payload]:
        packer = self.packer
        cuda = packer.stream is not None
        packer.begin()
        start_ev = _record(packer.stream) if cuda else None
        src = iter(source.tensors())
        sent = getattr(source, "bucket_sent", None)  # a source reusing its buffers
        slot_work: list = [None] * packer.slots
        works, wire = [], _WireClock(self._timing_stream)
        for k, bucket in enumerate(buckets):
            tensors = bucket_tensors(src, bucket)
            buf = direct_view(tensors, self.device)
            slot = k % packer.slots
            packed = buf is None
            if packed:
                prev = slot_work[slot]
                if prev is not None:  # the buffer is free once its last broadcast is done
                    if cuda:
                        with torch.cuda.stream(packer.stream):
                            prev.wait()  # a stream wait: the host does not block
                    else:
                        t0 = time.perf_counter()
                        watch.wait(prev.is_completed, f"broadcast (bucket {k + 1 - packer.slots}"
                                   f"/{len(buckets)})")
                        prev.wait()
                        stats.wait_s += time.perf_counter() - t0
                buf = packer.pack(slot, tensors, bucket.nbytes)
            pack_end = _record(packer.stream) if cuda else None
            # Update k+1 goes out once the engine answered update k. On GPUs an engine
            # (sglang, and the reference engine) answers as soon as it has enqueued the
            # receive and the load, so update k+1 travels while bucket k is on the wire.
            yield self._payload(k, len(buckets), bucket.metas, FLATTENED)
            work = self._broadcast(buf, packer.stream)
            wire.launched(work, pack_end)
            if packed:
                slot_work[slot] = work
            works.append((work, buf))  # a direct view keeps its tensor alive until sent
            if sent is not None:
                sent(k, (work,))
            stats.bytes += bucket.nbytes
            stats.buckets += 1
        self._drain(watch, stats, works)
        packer.finish()
        stats.pack_s += packer.pack_seconds()
        wire_s = wire.seconds(start_ev)
        if wire_s is not None:
            stats.wire_s = (stats.wire_s or 0.0) + wire_s

    def _per_tensor(self, source: WeightSource, buckets: Sequence[Bucket], watch: Watch,
                    stats: TransferStats) -> Iterator[Payload]:
        """sglang's per-tensor mode: one request per bucket, one broadcast per tensor."""
        src = iter(source.tensors())
        sent = getattr(source, "bucket_sent", None)
        works = []
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for k, bucket in enumerate(buckets):
            tensors = bucket_tensors(src, bucket)
            yield self._payload(k, len(buckets), bucket.metas, None)
            for t in tensors:
                t = t.detach().to(self.device).contiguous()
                works.append((self._broadcast(t, stream), t))
            if sent is not None:
                sent(k, [w for w, _ in works[-len(tensors):]])
            stats.bytes += bucket.nbytes
            stats.buckets += 1
        self._drain(watch, stats, works)

    @staticmethod
    def _drain(watch: Watch, stats: TransferStats, works: list) -> None:
        """Every broadcast done (or the first failure of an engine call raised)."""
        t0 = time.perf_counter()
        for w, _ in works:
            watch.wait(w.is_completed, "broadcast")
            w.wait()  # surfaces a collective's error (e.g. a peer that died)
        stats.wait_s += time.perf_counter() - t0


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


class _WireClock:
    """Broadcast time: on GPU from events on a side stream that waits on each broadcast."""

    def __init__(self, timing_stream: torch.cuda.Stream | None):
        self.stream = timing_stream
        self.marks: list[tuple[torch.cuda.Event | None, torch.cuda.Event | None]] = []
        self.cpu_start = time.perf_counter()

    def launched(self, work, pack_end: torch.cuda.Event | None) -> None:
        if self.stream is None:
            return
        with torch.cuda.stream(self.stream):
            work.wait()
            self.marks.append((pack_end, _record(self.stream)))

    def seconds(self, start: torch.cuda.Event | None) -> float | None:
        """Sum over buckets of done_k - max(ready_k, done_{k-1}): time the wire was busy."""
        if self.stream is None or start is None:
            return None
        self.stream.synchronize()
        total, prev_done = 0.0, 0.0
        for ready, done in self.marks:
            d = start.elapsed_time(done)
            r = start.elapsed_time(ready) if ready is not None else 0.0
            total += max(0.0, d - max(r, prev_done))
            prev_done = d
        return total / 1e3
