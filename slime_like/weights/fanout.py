"""Fan-out of engine calls during a sync: ordered per-engine lanes, all-engine steps, errors.

Every call names the engine (its URL) and the step, so a failed sync says where it failed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from slime_like.engine.handle import EngineHandle
from slime_like.errors import EngineError, WeightSyncError

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 - an item


def engine_ranks(engines: Sequence[EngineHandle]) -> tuple[list[int], int]:
    """sglang's layout: trainer rank 0, engine i at 1 + sum of earlier tp sizes."""
    offsets, offset = [], 1
    for e in engines:
        offsets.append(offset)
        offset += e.tp_size
    return offsets, offset


class CallCancelled(Exception):
    """A queued engine call that was never sent because the transfer had already failed."""


class EngineCalls:
    """Per engine, HTTP calls sent in submission order, each once its gate opens.

    Order matters: consecutive bucket updates describe consecutive broadcasts, so update
    k+1 must never reach an engine before update k. The default gate is "the previous call
    to this engine has been answered" (strict). A transport may pass a weaker gate that still
    implies update k was taken up by the engine (e.g. the trainer's broadcast of a large
    bucket k completed, which the engine cannot let happen before it joined), so that update
    k+1 travels while the engine still loads bucket k. Up to `depth` calls per engine are in
    flight; one dispatcher thread per engine waits on gates.
    """

    def __init__(self, engines: Sequence[EngineHandle], depth: int = 2):
        self._lanes = {e.url: _Lane(e.url, depth) for e in engines}

    def submit(self, engine: EngineHandle, fn: Callable[..., T], *args: Any,
               gate: Callable[[], bool] | None = None) -> Future[T]:
        return self._lanes[engine.url].submit(fn, args, gate)

    def cancel_pending(self) -> None:
        """Fail every call still waiting for its gate (after a transfer failed)."""
        for lane in self._lanes.values():
            lane.cancel_pending()

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()


class _Lane:
    """One engine's ordered calls: a dispatcher thread and a small pool running them."""

    def __init__(self, url: str, depth: int):
        self._queue: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix=f"engine-call-{url}")
        self._last: Future | None = None
        self._generation = 0  # bumped by cancel_pending: older queued calls are never sent
        self._thread = threading.Thread(target=self._dispatch, name=f"engine-gate-{url}",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, args: tuple, gate: Callable[[], bool] | None) -> Future:
        out: Future = Future()
        if gate is None:
            prev = self._last
            gate = (lambda: True) if prev is None else prev.done
        self._last = out
        self._queue.put((self._generation, gate, fn, args, out))
        return out

    def _dispatch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            generation, gate, fn, args, out = item
            while generation == self._generation:
                try:
                    if gate():
                        break
                except Exception:  # noqa: BLE001 - a broken gate (e.g. an aborted work): go
                    break
                time.sleep(5e-5)
            if generation != self._generation:
                out.set_exception(CallCancelled("not sent: the transfer had already failed"))
                continue
            out.set_running_or_notify_cancel()
            inner = self._pool.submit(fn, *args)
            inner.add_done_callback(lambda f, out=out: _copy_result(f, out))

    def cancel_pending(self) -> None:
        self._generation += 1
        self._last = None

    def close(self) -> None:
        self.cancel_pending()
        self._queue.put(None)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _copy_result(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


def each(items: Sequence[I], fn: Callable[[I], T], *,
         name: str = "each") -> list[tuple[T | None, Exception | None]]:
    """`fn(item)` for every item at once; per item, in order, (result, None) or (None, the
    error). Every call has ended when this returns. One item runs in the caller's thread:
    no thread to start and join on a hot path (a colocated sync's single engine). The
    fleet's fan-outs use it too."""
    def one(item: I) -> tuple[T | None, Exception | None]:
        try:
            return fn(item), None
        except Exception as err:  # noqa: BLE001 - the caller decides what a failure means
            return None, err

    if len(items) <= 1:
        return [one(item) for item in items]
    with ThreadPoolExecutor(len(items), thread_name_prefix=name) as pool:
        return list(pool.map(one, items))


def on_all(engines: Sequence[EngineHandle], step: str,
           fn: Callable[[EngineHandle], T]) -> list[T]:
    """Run fn on every engine concurrently; the first failure raises naming engine and step.

    Every call is waited for before raising, so no engine is left with a half-issued
    control call when the caller moves on to clean up.
    """
    outcomes = each(engines, fn, name=step)
    errors = [(e, err) for e, (_, err) in zip(engines, outcomes, strict=True) if err is not None]
    if errors:
        raise step_error(step, errors)
    return [result for result, _ in outcomes]


def step_error(step: str, errors: Sequence[tuple[EngineHandle, BaseException]]) -> WeightSyncError:
    """One WeightSyncError for failures on one or more engines (the first names the engine).

    A WeightSyncError raised by the call itself (e.g. WeightMetadataError) is kept, type
    and all, with the other engines' failures appended to its message.
    """
    first_engine, first = errors[0]
    others = "; also failed on " + ", ".join(
        f"{e.url} ({describe(x)})" for e, x in errors[1:]) if len(errors) > 1 else ""
    if isinstance(first, WeightSyncError):
        if others:
            first.args = (str(first) + others,)
        return first
    err = WeightSyncError(step, describe(first) + others, first_engine.url)
    err.__cause__ = first
    return err


def describe(exc: BaseException) -> str:
    if isinstance(exc, WeightSyncError):
        return exc.detail
    if isinstance(exc, EngineError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
