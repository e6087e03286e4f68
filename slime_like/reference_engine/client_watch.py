"""Answer a non-streamed request, or abort it once its client has gone (as sglang does).

uvicorn does not cancel a handler whose client closed the connection, so a non-streamed
request would run to its end for nobody. The handler's work runs as a task while the
connection is polled; a gone client cancels the task (the frontend then aborts the
request's sequences in the scheduler) and the handler answers 499.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")
POLL_S = 1.0


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def unless_client_gone(request: Request, work: Awaitable[T], poll_s: float = POLL_S) -> T:
    """The result of `work`, or ClientGone once the client disconnected (work cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
