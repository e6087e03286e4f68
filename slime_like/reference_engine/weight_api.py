"""sglang's weight-update endpoints, route and engine-level semantics in one place.

Each route hands its request struct to `WeightControl`, which applies sglang's gate, takes
the update lock and turns the request into a typed rank operation (`rank_ops`) for the
scheduler thread, which runs it between forward steps, in arrival order, like sglang's
scheduler: on rank 0 there, and on TP ranks 1..N-1 through their pipes (`TPGroup.run`).
Answers are `(success, message)` with sglang 0.5.23's texts. The route and its semantics
share a module because a weight's walk through the engine should be short: route, lock and
fan-out are one step of it (docs/ARCHITECTURE.md, "A weight tensor's walk"). Inspection and
memory endpoints are `weight_state.py`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse

from slime_like.protocol import io_struct as p
from slime_like.protocol import paths
from slime_like.protocol.weight_delta import XOR_ZSTD
from slime_like.reference_engine import rank_ops as op
from slime_like.reference_engine.frontend import Frontend
from slime_like.reference_engine.ipc_mappings import KEPT, LOAD, SESSION
from slime_like.reference_engine.rank_ops import RankOp
from slime_like.reference_engine.scheduler import Scheduler
from slime_like.reference_engine.tp import TPGroup
from slime_like.reference_engine.weight_receiver import Completion, WeightReceiver

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
        self._mappings_held = False  # a rank kept a mapping past the last session's end

    # ---- fan-out ---------------------------------------------------------------------------

    def _per_rank(self, ops: RankOp | Sequence[RankOp]) -> list[RankOp]:
        return list(ops) if isinstance(ops, list | tuple) else [ops] * self.tp.size

    def fanout_here(self, ops: RankOp | Sequence[RankOp]) -> list[tuple[bool, Any]]:
        """Already on the scheduler thread: run the operation on every rank."""
        return self.tp.run(self._per_rank(ops), self.receiver.run)

    async def fanout(self, ops: RankOp | Sequence[RankOp]) -> list[tuple[bool, Any]]:
        """The operation on every rank, on the scheduler thread; [(ok, result)] by rank."""
        return await asyncio.wrap_future(self.scheduler.call(
            functools.partial(self.tp.run, self._per_rank(ops), self.receiver.run)))

    @staticmethod
    def merge(results: list[tuple[bool, Any]]) -> tuple[bool, str]:
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
            await asyncio.wrap_future(self.scheduler.set_weight_version(weight_version))
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
        results = await self.fanout(op.InitGroup(
            master_address=req.master_address, master_port=req.master_port,
            rank_offset=req.rank_offset, world_size=req.world_size,
            group_name=req.group_name, backend=req.backend))
        ok, message = self.merge(results)
        if not ok:  # do not leave some ranks in a group the others failed to join
            await self.fanout(op.DestroyGroup(req.group_name))
        return ok, message

    async def destroy_group(self, req: p.DestroyWeightsUpdateGroupRequest) -> tuple[bool, str]:
        """/destroy_weights_update_group on every TP rank."""
        return self.merge(await self.fanout(op.DestroyGroup(req.group_name)))

    # ---- sessions --------------------------------------------------------------------------

    async def begin(self) -> tuple[bool, str]:
        """/begin_weight_update: open the 0.5.21+ update session."""
        async with self.frontend.model_update():
            if self.session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            self.session_open = True
            self._session_loaded = False
            # A receive that failed after the last session ended (its trainer had given up
            # on it) belongs to no session: it must not surface in this one's answers.
            self._pending_copies = []
            return True, "Weight update session started."

    async def end(self) -> tuple[bool, str]:
        """/end_weight_update: close the session; loaded weights become servable."""
        async with self.frontend.model_update():
            if not self.session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            failed = await self._settle_copies()
            if self._tensor_loads or self._mappings_held:  # else no rank holds a mapping
                self._tensor_loads = False
                held = await self.fanout(op.EndSession())
                self._mappings_held = any(not ok or value for ok, value in held)
            self.session_open = False
            if failed:
                return False, "; ".join(str(m) for _, m in failed)
            if self._session_loaded:
                self.scheduler.weights_ready = True
            return True, "Weight update session ended."

    # ---- updates ---------------------------------------------------------------------------

    async def update_from_distributed(self, req: p.UpdateWeightsFromDistributedRequest) -> tuple[bool, str]:
        """/update_weights_from_distributed: gate, lock, receive on every rank, version, flush."""
        if req.load_format == XOR_ZSTD and req.weight_delta is None:
            return False, (f"Failed to update parameter online: load_format {XOR_ZSTD!r} needs "
                           "the bucket's weight_delta header (base version, digests, sizes)")
        refused = self._gate("update_weights_from_distributed")
        if refused:
            return refused
        if req.abort_all_requests:
            await self.frontend.abort_request("", True)
        async with self.frontend.model_update():
            t0 = time.perf_counter()
            results = await self.fanout(self._receive_op(req))
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
            ok, message = self.merge(answered)
            self.metrics.weight_load(time.perf_counter() - t0)
            return await self._after_update(ok, message, req.weight_version, req.flush_cache)

    def _receive_op(self, req: p.UpdateWeightsFromDistributedRequest) -> RankOp:
        """A bucket's rank operation: a delta bucket names its base (`weight_delta`)."""
        if req.load_format != XOR_ZSTD:
            return op.ReceiveDistributed(names=req.names, dtypes=req.dtypes, shapes=req.shapes,
                                         group_name=req.group_name, load_format=req.load_format)
        return op.ReceiveDelta(names=req.names, dtypes=req.dtypes, shapes=req.shapes,
                               group_name=req.group_name,
                               header=req.weight_delta.model_dump(),
                               engine_version=self.scheduler.weight_version)

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
            self._tensor_loads = self._tensor_loads or self.session_open
            # A buffer's mapping stays open for the session (a rotating pack buffer is
            # opened once per sync), past it if the sender asks (it will send the same
            # buffer again), or only for this load outside a session (ipc_mappings.py).
            mapping = (KEPT if req.keep_ipc_mapping else SESSION) if self.session_open else LOAD
            results = await self.fanout([op.LoadTensorPayload(payloads[r], req.load_format,
                                                              mapping, req.ready_event)
                                          for r in range(self.tp.size)])
            ok, message = self.merge(results)
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
            results = await self.fanout(
                op.LoadDeltaFromDisk(req.model_path, self.scheduler.weight_version)
                if req.load_format == XOR_ZSTD else op.LoadFromDisk(req.model_path, req.load_format))
            ok, message = self.merge(results)
            self.metrics.weight_load(time.perf_counter() - t0)
            if ok:
                self.scheduler.weights_ready = True
            return await self._after_update(ok, message, req.weight_version, req.flush_cache)

    async def update_weight_version(self, req: p.UpdateWeightVersionRequest) -> tuple[bool, str]:
        """/update_weight_version: record a new version (aborting everything by default)."""
        if req.abort_all_requests:
            await self.frontend.abort_request("", True)
        await asyncio.wrap_future(self.scheduler.set_weight_version(req.new_version))
        return True, f"Weight version updated to {req.new_version}"


def success(ok: bool, message: str, **extra: Any) -> JSONResponse:
    """sglang's answer to a weight call: 200 with success true, else 400."""
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)


def register_weight_routes(app: FastAPI, engine: Any) -> None:
    """The weight-update routes of one engine (`engine.weight_control` answers them)."""
    weights: WeightControl = engine.weight_control

    @app.post(paths.INIT_WEIGHTS_UPDATE_GROUP)
    async def init_weights_update_group(obj: Annotated[p.InitWeightsUpdateGroupRequest, Body()]):
        return success(*await weights.init_group(obj))

    @app.post(paths.DESTROY_WEIGHTS_UPDATE_GROUP)
    async def destroy_weights_update_group(obj: Annotated[p.DestroyWeightsUpdateGroupRequest, Body()]):
        return success(*await weights.destroy_group(obj))

    @app.post(paths.BEGIN_WEIGHT_UPDATE)
    async def begin_weight_update(obj: Annotated[p.BeginWeightUpdateRequest, Body()]):
        return success(*await weights.begin())

    @app.post(paths.END_WEIGHT_UPDATE)
    async def end_weight_update(obj: Annotated[p.EndWeightUpdateRequest, Body()]):
        return success(*await weights.end())

    @app.post(paths.UPDATE_WEIGHTS_FROM_DISTRIBUTED)
    async def update_weights_from_distributed(obj: Annotated[p.UpdateWeightsFromDistributedRequest, Body()]):
        return success(*await weights.update_from_distributed(obj))

    @app.post(paths.UPDATE_WEIGHTS_FROM_TENSOR)
    async def update_weights_from_tensor(obj: Annotated[p.UpdateWeightsFromTensorRequest, Body()]):
        try:
            return success(*await weights.update_from_tensor(obj))
        except Exception as e:  # noqa: BLE001 - sglang's scheduler crashes here; we answer 400
            return success(False, f"Failed to update weights from tensor: {e}")

    @app.post(paths.UPDATE_WEIGHTS_FROM_DISK)
    async def update_weights_from_disk(obj: Annotated[p.UpdateWeightsFromDiskRequest, Body()]):
        ok, message = await weights.update_from_disk(obj)
        if ok and obj.load_format != XOR_ZSTD:  # a delta changes weights, not the checkpoint
            engine.model_path = engine.served_model_name = obj.model_path
            if obj.load_format:
                engine.load_format = obj.load_format
        return success(ok, message, num_paused_requests=0)

    @app.post(paths.UPDATE_WEIGHT_VERSION)
    async def update_weight_version(obj: Annotated[p.UpdateWeightVersionRequest, Body()]):
        ok, message = await weights.update_weight_version(obj)
        return success(ok, message, **({"new_version": obj.new_version} if ok else {}))
