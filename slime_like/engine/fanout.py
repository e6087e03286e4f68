"""One call fanned out to many engines' sessions at once, every engine's outcome kept.

The calls run on the process's engine-call pool (`session.engine_pool`), or, written as
steps (`engine/steps.py`), on its engine-call loop (`each_steps`, `on_all_steps`: no
thread per engine); a failure is named by engine and step (`WeightSyncError`), after every
call ended, so no engine is left with a half-issued call while the caller cleans up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from slime_like.engine.call_pool import io_loop
from slime_like.engine.session import EngineSession, engine_pool
from slime_like.engine.steps import Steps, drive
from slime_like.errors import EngineError, WeightSyncError

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 - an item


def each(items: Sequence[I], fn: Callable[[I], T]) -> list[tuple[T | None, Exception | None]]:
    """`fn(item)` for every item at once; per item, in order, (result, None) or (None, the
    error). Every call has ended when this returns. One item runs in the caller's thread:
    no hop on a hot path (a colocated sync's single engine)."""
    def one(item: I) -> tuple[T | None, Exception | None]:
        try:
            return fn(item), None
        except Exception as err:  # noqa: BLE001 - the caller decides what a failure means
            return None, err

    if len(items) <= 1:
        return [one(item) for item in items]
    futures = [engine_pool().submit(one, item) for item in items]
    return [f.result() for f in futures]


def start_steps(items: Sequence[I], fn: Callable[[I], Steps[T]]) -> list[Future[T]]:
    """`fn(item)`'s steps for every item, started on the engine-call loop at once."""
    loop = io_loop()
    futures: list[Future[T]] = []
    for item in items:
        future: Future[T] = Future()
        loop.start(fn, (item,), future)
        futures.append(future)
    return futures


def each_steps(items: Sequence[I], fn: Callable[[I], Steps[T]]
               ) -> list[tuple[T | None, BaseException | None]]:
    """As `each`, for calls written as steps: the engine-call loop runs them all, where a
    thread per engine cost several times the calls' own work at 64 engines. One item runs
    on the caller's thread, as in `each`."""
    if len(items) <= 1:
        return each(items, lambda item: drive(fn(item)))
    futures = start_steps(items, fn)
    return [(None, err) if (err := f.exception()) is not None else (f.result(), None)
            for f in futures]


def on_all(sessions: Sequence[EngineSession], step: str,
           fn: Callable[[EngineSession], T]) -> list[T]:
    """fn on every session at once; the first failure raises naming the engine and the step,
    after every call ended (no engine is left with a half-issued call)."""
    return _raise_first(sessions, step, each(sessions, fn))


def on_all_steps(sessions: Sequence[EngineSession], step: str,
                 fn: Callable[[EngineSession], Steps[T]]) -> list[T]:
    """As `on_all`, for calls written as steps, on the engine-call loop (`each_steps`)."""
    return _raise_first(sessions, step, each_steps(sessions, fn))


def _raise_first(sessions: Sequence[EngineSession], step: str,
                 outcomes: Sequence[tuple[T | None, BaseException | None]]) -> list[T]:
    errors = [(s, err) for s, (_, err) in zip(sessions, outcomes, strict=True) if err is not None]
    if errors:
        raise step_error(step, errors)
    return [result for result, _ in outcomes]


def step_error(step: str, errors: Sequence[tuple[EngineSession, BaseException]]) -> WeightSyncError:
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
