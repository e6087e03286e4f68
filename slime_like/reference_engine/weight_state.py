"""sglang's endpoints on the weights at rest: inspection and memory release/resume.

`/get_weights_by_name` and `/weights_checker` read the ranks' parameters; the memory
endpoints drop and give back weight and KV storage by tag (idle engine only, as sglang
asserts). Each runs on the scheduler thread through `WeightControl`'s fan-out to every TP
rank (`weight_api.py`), which owns the update endpoints.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from typing import Annotated, Any

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse

from slime_like.protocol import io_struct as p
from slime_like.protocol import paths
from slime_like.reference_engine import rank_ops as op
from slime_like.reference_engine.weight_api import WeightControl


class WeightState:
    """Inspection and memory endpoints of one engine (all TP ranks)."""

    def __init__(self, control: WeightControl):
        self.control = control
        self.released_tags: set[str] = set()
        self._snapshot: dict | None = None

    # ---- inspection ------------------------------------------------------------------------

    async def get_weights_by_name(self, req: p.GetWeightsByNameRequest) -> list | None:
        """/get_weights_by_name: the first rows of one parameter on rank 0."""
        return await asyncio.wrap_future(self.control.scheduler.call(functools.partial(
            self.control.receiver.get_weights_by_name, req.name, req.truncate_size)))

    async def check_weights(self, req: p.WeightsCheckerRequest) -> dict:
        """/weights_checker: per-rank checksums, snapshot and compare."""
        if req.action == "checksum":
            results = await self.control.fanout(op.Checksums(req.skip_tensor_list))
            if not all(ok for ok, _ in results):
                return {"success": False, "message": self.control.merge(results)[1]}
            ranks = [value for _, value in results]
            h = hashlib.sha256()
            for r in ranks:
                h.update(r["per_gpu_checksum"].encode())
            return {"success": True, "message": "Success.", "ranks": ranks,
                    "per_engine_checksum": h.hexdigest()}
        if req.action == "snapshot":
            results = await self.control.fanout(op.Checksums(req.skip_tensor_list))
            self._snapshot = {i: v["checksums"] for i, (_, v) in enumerate(results)}
            return {"success": True, "message": "Success."}
        if req.action == "compare":
            if self._snapshot is None:
                return {"success": False, "message": "compare needs a snapshot: call action='snapshot' first"}
            results = await self.control.fanout(op.Checksums(req.skip_tensor_list))
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
            if not self.control.scheduler.is_idle():
                raise ValueError(
                    "release_memory_occupation needs an idle engine (no running requests; "
                    "pause and drain first); sglang asserts this and crashes")
            already = [t for t in tags if t in self.released_tags]
            if already:
                raise ValueError(f"memory tags {already} are already released")
            if "kv_cache" in tags:
                self.control.scheduler.flush_now()
                self.control.scheduler.pool.release()
            if "weights" in tags:
                results = self.control.fanout_here(op.ReleaseWeights())
                ok, message = self.control.merge(results)
                if not ok:
                    raise ValueError(f"releasing weights failed: {message}")
                self.control.scheduler.weights_ready = False
            self.released_tags.update(tags)

        await asyncio.wrap_future(self.control.scheduler.call(release))

    async def resume_memory(self, tags: list[str] | None) -> None:
        """/resume_memory_occupation: give released storage back."""
        tags = list(tags or p.ALL_MEMORY_TAGS)

        def resume() -> None:
            missing = [t for t in tags if t not in self.released_tags]
            if missing:
                raise ValueError(f"memory tags {missing} were not released (released: "
                                 f"{sorted(self.released_tags)}); sglang raises KeyError here")
            if "weights" in tags:
                results = self.control.fanout_here(op.ResumeWeights())
                ok, message = self.control.merge(results)
                if not ok:
                    raise ValueError(f"resuming weights failed: {message}")
                # Contents came back only with --enable-weights-cpu-backup; otherwise the
                # engine serves nothing until a weight update arrives.
                self.control.scheduler.weights_ready = all(v is True for _, v in results)
            if "kv_cache" in tags:
                self.control.scheduler.pool.allocate()
            self.released_tags.difference_update(tags)

        await asyncio.wrap_future(self.control.scheduler.call(resume))


def _error_400(e: Exception) -> JSONResponse:
    return JSONResponse(p.error_response_body(str(e)), status_code=getattr(e, "status_code", 400))


def register_weight_state_routes(app: FastAPI, engine: Any) -> None:
    """The inspection and memory routes of one engine."""
    state = WeightState(engine.weight_control)

    @app.api_route(paths.GET_WEIGHTS_BY_NAME, methods=["GET", "POST"])
    async def get_weights_by_name(obj: Annotated[p.GetWeightsByNameRequest, Body()]):
        try:
            value = await state.get_weights_by_name(obj)
        except Exception as e:  # noqa: BLE001
            return _error_400(e)
        if value is None:
            return _error_400(ValueError("Get parameter by name failed"))
        return value

    @app.api_route(paths.WEIGHTS_CHECKER, methods=["GET", "POST"])
    async def weights_checker(obj: Annotated[p.WeightsCheckerRequest | None, Body()] = None):
        body = await state.check_weights(obj or p.WeightsCheckerRequest())
        return JSONResponse(body, status_code=200 if body["success"] else 400)

    @app.api_route(paths.RELEASE_MEMORY_OCCUPATION, methods=["GET", "POST"])
    async def release_memory_occupation(obj: Annotated[p.MemoryOccupationRequest, Body()]):
        try:
            await state.release_memory(obj.tags)
        except Exception as e:  # noqa: BLE001
            return _error_400(e)
        return None

    @app.api_route(paths.RESUME_MEMORY_OCCUPATION, methods=["GET", "POST"])
    async def resume_memory_occupation(obj: Annotated[p.MemoryOccupationRequest, Body()]):
        try:
            await state.resume_memory(obj.tags)
        except Exception as e:  # noqa: BLE001
            return _error_400(e)
        return None
