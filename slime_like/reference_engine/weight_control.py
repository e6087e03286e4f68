"""Engine-level weight operations: sglang's gate, locking, versioning and flush semantics.

Each endpoint turns its request into a typed rank operation (`rank_ops`) and hands it to
the scheduler thread, which runs it between forward steps, in arrival order, like
sglang's scheduler: on rank 0 there, and on TP ranks 1..N-1 through their pipes
(`TPGroup.run`). Answers are `(success, message)` with sglang 0.5.23's texts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

from slime_like.protocol import io_struct as p
from slime_like.reference_engine import rank_ops as op
from slime_like.reference_engine.frontend import Frontend
from slime_like.reference_engine.rank_ops import Completion, RankOp
from slime_like.reference_engine.scheduler import Scheduler
from slime_like.reference_engine.tp import TPGroup
from slime_like.reference_engine.weight_receiver import WeightReceiver

logger = logging.getLogger(__name__)

FLUSH_AFTER_UPDATE_FAILED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache.")


class WeightControl:
    """Weight endpoints of one engine (all TP ranks)."""

    def __init__(self, *, receiver: WeightReceiver, tp: TPGroup, scheduler: Scheduler,
                 frontend: Frontend, metrics: Any, gate: str):
        self.receiver = receiver
        self.tp = tp
        self.scheduler = scheduler
        self.frontend = frontend
        self.metrics = metrics
        self.gate_strict = gate == "strict"
        self.session_open = False
        # CUDA copies of distributed buckets answered before they finished (as sglang does:
        # its scheduler answers once the receive and the load are enqueued); the session's
        # end, a version change and every forward step wait for them.
        self._pending_copies: list[Completion] = []
        self._session_loaded = False
        self._tensor_loads = False  # tensor payloads loaded in this session (IPC storages)
        self.released_tags: set[str] = set()
        self._snapshot: dict | None = None

    # ---- fan-out ---------------------------------------------------------------------------

    def _per_rank(self, ops: RankOp | Sequence[RankOp]) -> list[RankOp]:
        return list(ops) if isinstance(ops, list | tuple) else [ops] * self.tp.size

    def _fanout_here(self, ops: RankOp | Sequence[RankOp]) -> list[tuple[bool, Any]]:
        """Already on the scheduler thread: run the operation on every rank."""
        return self.tp.run(self._per_rank(ops), self.receiver.run)

    async def _fanout(self, ops: RankOp | Sequence[RankOp]) -> list[tuple[bool, Any]]:
        """The operation on every rank, on the scheduler thread; [(ok, result)] by rank."""
        return await asyncio.wrap_future(self.scheduler.call(
            functools.partial(self.tp.run, self._per_rank(ops), self.receiver.run)))

    @staticmethod
    def _merge(results: list[tuple[bool, Any]]) -> tuple[bool, str]:
        """sglang's merge: success only if every rank succeeded; messages joined with ' | '."""
        oks, messages = [], []
        for ok, value in results:
            if ok and isinstance(value, tuple):
                ok, value = value
            oks.append(ok)
            messages.append(str(value))
        unique = list(dict.fromkeys(messages))
        return all(oks), " | ".join(unique)

    def _gate(self, endpoint: str) -> tuple[bool, str] | None:
        if self.gate_strict and not self.session_open:
            return False, (f"{endpoint} must run between begin_weight_update() and "
                           "end_weight_update()")
        return None

    async def _after_update(self, ok: bool, message: str, weight_version: str | None,
                            flush_cache: bool) -> tuple[bool, str]:
        """Record the version and flush, as sglang's scheduler does after applying weights."""
        if not ok:
            return ok, message
        if self.session_open:
            self._session_loaded = True
        else:
            self.scheduler.weights_ready = True
        if weight_version is not None:
            await asyncio.wrap_future(self.scheduler.call(
                lambda: self.scheduler.record_weight_version(weight_version)))
            message += f" Weight version updated to {weight_version}."
        if flush_cache:
            flushed, _ = await asyncio.wrap_future(self.scheduler.flush(0.0))
            if not flushed:
                return False, FLUSH_AFTER_UPDATE_FAILED
        return ok, message

    async def _settle_copies(self) -> list[tuple[bool, Any]]:
        """Wait (off the event loop) for every pending CUDA copy; failures as merge entries."""
        pending, self._pending_copies = self._pending_copies, []
        if not pending:
            return []
        results = await asyncio.to_thread(lambda: [c.wait() for c in pending])
        return [(ok, msg) for ok, msg in results if not ok]

    # ---- groups ----------------------------------------------------------------------------

    async def init_group(self, req: p.InitWeightsUpdateGroupRequest) -> tuple[bool, str]:
        """/init_weights_update_group on every TP rank (blocks until the rendezvous)."""
        results = await self._fanout(op.InitGroup(
            master_address=req.master_address, master_port=req.master_port,
            rank_offset=req.rank_offset, world_size=req.world_size,
            group_name=req.group_name, backend=req.backend))
        ok, message = self._merge(results)
        if not ok:  # do not leave some ranks in a group the others failed to join
            await self._fanout(op.DestroyGroup(req.group_name))
        return ok, message

    async def destroy_group(self, req: p.DestroyWeightsUpdateGroupRequest) -> tuple[bool, str]:
        """/destroy_weights_update_group on every TP rank."""
        return self._merge(await self._fanout(op.DestroyGroup(req.group_name)))

    # ---- sessions --------------------------------------------------------------------------

    async def begin(self) -> tuple[bool, str]:
        """/begin_weight_update: open the 0.5.21+ update session."""
        async with self.frontend.model_update():
            if self.session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            self.session_open = True
            self._session_loaded = False
            return True, "Weight update session started."

    async def end(self) -> tuple[bool, str]:
        """/end_weight_update: close the session; loaded weights become servable."""
        async with self.frontend.model_update():
            if not self.session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            failed = await self._settle_copies()
            if self._tensor_loads:  # only then can a rank hold IPC storages to let go of
                self._tensor_loads = False
                await self._fanout(op.EndSession())
            self.session_open = False
            if failed:
                return False, "; ".join(str(m) for _, m in failed)
            if self._session_loaded:
                self.scheduler.weights_ready = True
            return True, "Weight update session ended."

    # ---- updates ---------------------------------------------------------------------------

    async def update_from_distributed(self, req: p.UpdateWeightsFromDistributedRequest) -> tuple[bool, str]:
        """/update_weights_from_distributed: gate, lock, receive on every rank, version, flush."""
        refused = self._gate("update_weights_from_distributed")
        if refused:
            return refused
        if req.abort_all_requests:
            await self.frontend.abort_request("", True)
        async with self.frontend.model_update():
            t0 = time.perf_counter()
            results = await self._fanout(op.ReceiveDistributed(
                names=req.names, dtypes=req.dtypes, shapes=req.shapes,
                group_name=req.group_name, load_format=req.load_format))
            answered = []
            for ok, value in results:
                if ok and isinstance(value, Completion):
                    # On CUDA the copy may still run; the next bucket's receive is launched
                    # behind it. Answer now inside a session; settle before anything that
                    # makes the weights visible (a version change, the end, no session).
                    self._pending_copies.append(value)
                    answered.append((True, (value.ok, value.message)))
                else:
                    answered.append((ok, value))
            if req.weight_version is not None or not self.session_open:
                answered = [(ok, v) for ok, v in answered] + await self._settle_copies()
            ok, message = self._merge(answered)
            self.metrics.weight_load(time.perf_counter() - t0)
            return await self._after_update(ok, message, req.weight_version, req.flush_cache)

    async def update_from_tensor(self, req: p.UpdateWeightsFromTensorRequest) -> tuple[bool, str]:
        """/update_weights_from_tensor: one payload per TP rank through the safe unpickler."""
        refused = self._gate("update_weights_from_tensor")
        if refused:
            return refused
        payloads = req.serialized_named_tensors
        if len(payloads) != self.tp.size:
            return False, (f"serialized_named_tensors has {len(payloads)} entries but this engine has "
                           f"tp_size {self.tp.size}: send one payload per TP rank")
        if req.abort_all_requests:
            await self.frontend.abort_request("", True)
        t_lock = time.perf_counter()
        async with self.frontend.model_update():
            t0 = time.perf_counter()
            self._tensor_loads = self.session_open
            results = await self._fanout([op.LoadTensorPayload(payloads[r], req.load_format)
                                          for r in range(self.tp.size)])
            ok, message = self._merge(results)
            t1 = time.perf_counter()
            self.metrics.weight_load(t1 - t0)
            answer = await self._after_update(ok, message, req.weight_version, req.flush_cache)
            logger.debug("update_weights_from_tensor: lock %.2f ms, ranks %.2f ms, version and "
                         "flush %.2f ms", (t0 - t_lock) * 1e3, (t1 - t0) * 1e3,
                         (time.perf_counter() - t1) * 1e3)
            return answer

    async def update_from_disk(self, req: p.UpdateWeightsFromDiskRequest) -> tuple[bool, str]:
        """/update_weights_from_disk: every rank loads the checkpoint or rolls back."""
        if req.abort_all_requests:
            await self.frontend.abort_request("", True)
        async with self.frontend.model_update():
            t0 = time.perf_counter()
            results = await self._fanout(op.LoadFromDisk(req.model_path, req.load_format))
            ok, message = self._merge(results)
            self.metrics.weight_load(time.perf_counter() - t0)
            if ok:
                self.scheduler.weights_ready = True
            return await self._after_update(ok, message, req.weight_version, req.flush_cache)

    async def update_weight_version(self, req: p.UpdateWeightVersionRequest) -> tuple[bool, str]:
        """/update_weight_version: record a new version (aborting everything by default)."""
        if req.abort_all_requests:
            await self.frontend.abort_request("", True)
        await asyncio.wrap_future(self.scheduler.call(
            lambda: self.scheduler.record_weight_version(req.new_version)))
        return True, f"Weight version updated to {req.new_version}"

    # ---- inspection ------------------------------------------------------------------------

    async def get_weights_by_name(self, req: p.GetWeightsByNameRequest) -> list | None:
        """/get_weights_by_name: the first rows of one parameter on rank 0."""
        return await asyncio.wrap_future(self.scheduler.call(
            lambda: self.receiver.get_weights_by_name(req.name, req.truncate_size)))

    async def check_weights(self, req: p.WeightsCheckerRequest) -> dict:
        """/weights_checker: per-rank checksums, snapshot and compare."""
        if req.action == "checksum":
            results = await self._fanout(op.Checksums(req.skip_tensor_list))
            if not all(ok for ok, _ in results):
                return {"success": False, "message": self._merge(results)[1]}
            ranks = [value for _, value in results]
            import hashlib

            h = hashlib.sha256()
            for r in ranks:
                h.update(r["per_gpu_checksum"].encode())
            return {"success": True, "message": "Success.", "ranks": ranks,
                    "per_engine_checksum": h.hexdigest()}
        if req.action == "snapshot":
            results = await self._fanout(op.Checksums(req.skip_tensor_list))
            self._snapshot = {i: v["checksums"] for i, (_, v) in enumerate(results)}
            return {"success": True, "message": "Success."}
        if req.action == "compare":
            if self._snapshot is None:
                return {"success": False, "message": "compare needs a snapshot: call action='snapshot' first"}
            results = await self._fanout(op.Checksums(req.skip_tensor_list))
            diff = [f"tp{i}:{name}" for i, (_, v) in enumerate(results)
                    for name, c in v["checksums"].items() if self._snapshot.get(i, {}).get(name) != c]
            if diff:
                return {"success": False, "message": f"{len(diff)} tensors differ from the snapshot: {diff[:10]}"}
            return {"success": True, "message": "Success."}
        return {"success": False, "message": f"action {req.action!r} is not supported by the reference engine"}

    # ---- memory ----------------------------------------------------------------------------

    async def release_memory(self, tags: list[str] | None) -> None:
        """/release_memory_occupation: drop weights / KV (idle engine only)."""
        tags = list(tags or p.ALL_MEMORY_TAGS)

        def release() -> None:
            if not self.scheduler.is_idle():
                raise ValueError(
                    "release_memory_occupation needs an idle engine (no running requests; "
                    "pause and drain first); sglang asserts this and crashes")
            already = [t for t in tags if t in self.released_tags]
            if already:
                raise ValueError(f"memory tags {already} are already released")
            if "kv_cache" in tags:
                self.scheduler.flush_now()
                self.scheduler.pool.release()
            if "weights" in tags:
                results = self._fanout_here(op.ReleaseWeights())
                ok, message = self._merge(results)
                if not ok:
                    raise ValueError(f"releasing weights failed: {message}")
                self.scheduler.weights_ready = False
            self.released_tags.update(tags)

        await asyncio.wrap_future(self.scheduler.call(release))

    async def resume_memory(self, tags: list[str] | None) -> None:
        """/resume_memory_occupation: give released storage back."""
        tags = list(tags or p.ALL_MEMORY_TAGS)

        def resume() -> None:
            missing = [t for t in tags if t not in self.released_tags]
            if missing:
                raise ValueError(f"memory tags {missing} were not released (released: "
                                 f"{sorted(self.released_tags)}); sglang raises KeyError here")
            if "weights" in tags:
                results = self._fanout_here(op.ResumeWeights())
                ok, message = self._merge(results)
                if not ok:
                    raise ValueError(f"resuming weights failed: {message}")
                # Contents came back only with --enable-weights-cpu-backup; otherwise the
                # engine serves nothing until a weight update arrives.
                self.scheduler.weights_ready = all(v is True for _, v in results)
            if "kv_cache" in tags:
                self.scheduler.pool.allocate()
            self.released_tags.difference_update(tags)

        await asyncio.wrap_future(self.scheduler.call(resume))
