"""The FastAPI app: sglang 0.5.23's routes, status codes, bodies, auth and error envelopes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from enum import Enum
from typing import Annotated, Any

from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from slime_like.protocol import io_struct as p
from slime_like.protocol import paths
from slime_like.reference_engine import loads as load_shape
from slime_like.reference_engine.client_watch import ClientGone, unless_client_gone
from slime_like.reference_engine.disaggregation import HandoffError
from slime_like.reference_engine.engine import ReferenceEngine
from slime_like.reference_engine.frontend import EngineUnavailable
from slime_like.reference_engine.openai_api import register_openai_routes
from slime_like.reference_engine.profiler import Profiler
from slime_like.reference_engine.sampling import SchemaError
from slime_like.reference_engine.weight_api import register_weight_routes
from slime_like.reference_engine.weight_state import register_weight_state_routes

logger = logging.getLogger(__name__)


class AuthLevel(str, Enum):
    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


# sglang marks every weight, cache, pause, abort, profile and memory endpoint ADMIN_OPTIONAL.
ADMIN_OPTIONAL_PATHS = frozenset({
    "/flush_cache", "/start_profile", "/stop_profile", "/freeze_gc", "/update_weights_from_disk",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_tensor",
    "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
    "/update_weight_version", "/get_weights_by_name", "/release_memory_occupation",
    "/resume_memory_occupation", "/weights_checker", "/abort_request", "/pause_generation",
    "/continue_generation", "/slow_down", "/configure_logging", "/set_internal_state",
})
OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def _bearer_ok(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token, key)


def decide_auth(method: str, path: str, header: str | None, api_key: str | None,
                admin_api_key: str | None, level: AuthLevel) -> int | None:
    """None when allowed, else the status (401/403) — sglang's auth rules (docs/REFERENCE_ENGINE.md, "Other endpoints": auth)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return None
    if level == AuthLevel.ADMIN_FORCE:
        if not admin_api_key:
            return 403
        return None if _bearer_ok(header, admin_api_key) else 401
    if level == AuthLevel.ADMIN_OPTIONAL:
        if admin_api_key:
            return None if _bearer_ok(header, admin_api_key) else 401
        if api_key:
            return None if _bearer_ok(header, api_key) else 401
        return None
    if api_key:
        return None if _bearer_ok(header, api_key) else 401
    return None


class AuthMiddleware:
    """ASGI middleware (not BaseHTTPMiddleware) so client disconnects still reach handlers."""

    def __init__(self, app, api_key: str | None, admin_api_key: str | None):
        self.app = app
        self.api_key, self.admin_api_key = api_key, admin_api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (self.api_key or self.admin_api_key):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        level = AuthLevel.ADMIN_OPTIONAL if path in ADMIN_OPTIONAL_PATHS else AuthLevel.NORMAL
        status = decide_auth(scope["method"], path, headers.get("authorization"), self.api_key,
                             self.admin_api_key, level)
        if status is None:
            await self.app(scope, receive, send)
            return
        body = {"error": "Unauthorized" if status == 401 else "Forbidden"}
        await JSONResponse(body, status_code=status)(scope, receive, send)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def create_app(engine: ReferenceEngine) -> FastAPI:
    """The HTTP surface of one reference engine."""
    frontend = engine.frontend
    scheduler = engine.scheduler
    profiler = Profiler(scheduler)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        frontend.bind_loop()
        task = None
        if engine.args.skip_server_warmup:
            frontend.ready = True
        else:
            async def warm() -> None:
                try:
                    await frontend.warmup()
                    frontend.ready = True
                    logger.info("The server is fired up and ready to roll!")
                except Exception:  # noqa: BLE001 - sglang kills the server when warm-up fails
                    logger.exception("warm-up generation failed; shutting down")
                    os.kill(os.getpid(), 15)
            task = asyncio.create_task(warm())
        yield
        if task is not None:
            task.cancel()
        engine.shutdown()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(AuthMiddleware, api_key=engine.args.api_key,
                       admin_api_key=engine.args.admin_api_key)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = str(exc.errors())
        text = str(exc)
        message = f"{text} {errors}" if errors and errors != text else text
        return JSONResponse(p.validation_error_body(message), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse(p.http_exception_body(str(exc.detail), exc.status_code),
                            status_code=exc.status_code)

    def error_400(e: Exception) -> JSONResponse:
        return JSONResponse(p.error_response_body(str(e)), status_code=getattr(e, "status_code", 400))

    # ---- generation ------------------------------------------------------------------------

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        if not raw:
            raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                           "input": None}])
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos),
                                           "msg": "JSON decode error", "input": {},
                                           "ctx": {"error": e.msg}}]) from e
        except (RecursionError, UnicodeDecodeError) as e:  # nested too deep; not UTF-8
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                           "msg": f"JSON decode error: {type(e).__name__}",
                                           "input": {}}]) from e

    @app.api_route(paths.GENERATE, methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await read_json(request)
        try:
            job = frontend.parse(body)
        except SchemaError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except ValueError as e:
            return error_400(e)
        if job.stream:
            async def stream() -> AsyncIterator[bytes]:
                try:
                    async for index, out in frontend.run(job):
                        if not job.is_single:
                            out["index"] = index
                        yield _sse(out)
                except (ValueError, EngineUnavailable, HandoffError) as e:
                    code = 503 if isinstance(e, EngineUnavailable) else getattr(e, "status_code", 400)
                    yield _sse({"error": {"message": str(e), "type": "invalid_request_error",
                                          "code": code, "retryable": code == 503}})
                yield b"data: [DONE]\n\n"
            return StreamingResponse(stream(), media_type="text/event-stream")
        try:
            return JSONResponse(await unless_client_gone(request, frontend.generate(job)))
        except ClientGone:  # sglang aborts the requests of a client that went away
            return Response(status_code=499)
        except ValueError as e:
            return error_400(e)
        except EngineUnavailable as e:
            raise HTTPException(status_code=503, detail=str(e)) from e
        except HandoffError as e:  # sglang aborts the request with 500 when the KV never came
            raise HTTPException(status_code=e.status_code, detail=str(e)) from e

    # ---- health and info -------------------------------------------------------------------

    @app.get(paths.HEALTH)
    @app.get(paths.HEALTH_GENERATE)
    async def health() -> Response:
        if not frontend.ready:
            return Response(status_code=503)
        return Response(status_code=200 if await frontend.health_generate() else 503)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if frontend.ready and not frontend.paused else 503)

    @app.get(paths.PING)
    async def ping() -> Response:
        return Response(status_code=200 if frontend.ready else 503)

    @app.get(paths.MODEL_INFO)
    @app.get("/get_model_info")
    async def model_info():
        return engine.model_info()

    @app.get(paths.SERVER_INFO)
    @app.get(paths.GET_SERVER_INFO)
    async def server_info():
        await frontend.settled()  # its internal_states, as /v1/loads
        return engine.server_info()

    @app.get(paths.V1_LOADS)
    async def v1_loads(include: str | None = None, format: str = "json",
                       dp_rank: int | None = None):
        try:
            wanted = load_shape.parse_include(include)
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        if dp_rank not in (None, 0):
            raise HTTPException(400, f"dp_rank {dp_rank} out of range [0, 1)")
        await frontend.settled()  # queued behind a pause, as sglang's read is
        entry = load_shape.select(engine.load_entry(), wanted)
        if format == "prometheus":
            return Response(load_shape.prometheus_text([entry]),
                            media_type="text/plain; version=0.0.4; charset=utf-8")
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": "0.5.23",
                "accelerator": engine.args.device, "num_accelerators": engine.args.tp_size,
                "loads": [entry]}

    @app.get("/get_load")
    async def get_load():
        # Removed in sglang 0.5.21, kept because sglang-router 0.3.2 polls it (power_of_two).
        await frontend.settled()
        load = scheduler.load()
        return [{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                 "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_active_tokens"],
                 "num_pending_tokens": load["num_waiting_uncached_tokens"], "ts_tic": time.time()}]

    if engine.metrics.enabled:
        @app.get("/metrics")
        async def metrics():
            await frontend.settled()  # the counters after a pause, as /v1/loads
            return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- cache, pause, abort, profile ------------------------------------------------------

    @app.api_route(paths.FLUSH_CACHE, methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)):
        ok, message = await asyncio.wrap_future(scheduler.flush(timeout))
        return Response(message, status_code=200 if ok else 400, media_type="text/plain")

    @app.post(paths.ABORT_REQUEST)
    async def abort_request(obj: Annotated[p.AbortRequest, Body()]):
        await frontend.abort_request(obj.rid, obj.abort_all)
        return Response(status_code=200)

    @app.post(paths.PAUSE_GENERATION)
    async def pause_generation(obj: Annotated[p.PauseGenerationRequest, Body()]):
        await frontend.pause(obj.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post(paths.CONTINUE_GENERATION)
    async def continue_generation(obj: Annotated[p.ContinueGenerationRequest, Body()]):
        await frontend.continue_generation()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route(paths.START_PROFILE, methods=["GET", "POST"])
    async def start_profile(obj: Annotated[p.ProfileRequest | None, Body()] = None):
        try:
            await profiler.start(obj or p.ProfileRequest())
        except RuntimeError as e:
            raise HTTPException(500, str(e)) from e
        return Response("Start profiling.\n", media_type="text/plain")

    @app.api_route(paths.STOP_PROFILE, methods=["GET", "POST"])
    async def stop_profile():
        try:
            await profiler.stop()
        except RuntimeError as e:
            raise HTTPException(500, str(e)) from e
        return Response("Stop profiling. This will take some time.\n", media_type="text/plain")

    register_weight_routes(app, engine)
    register_weight_state_routes(app, engine)
    register_openai_routes(app, engine)
    return app
