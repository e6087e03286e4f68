"""One call fanned out to many engines' sessions at once, every engine's outcome kept.

The calls run on the process's engine-call pool (`session.engine_pool`); a failure is
named by engine and step (`WeightSyncError`), after every call ended, so no engine is left
with a half-issued call while the caller cleans up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from slime_like.engine.session import EngineSession, engine_pool
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


def on_all(sessions: Sequence[EngineSession], step: str,
           fn: Callable[[EngineSession], T]) -> list[T]:
    """fn on every session at once; the first failure raises naming the engine and the step,
    after every call ended (no engine is left with a half-issued call)."""
    outcomes = each(sessions, fn)
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
