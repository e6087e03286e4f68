"""A control call written once, run on a thread or on the engine-call loop.

A verb of a sync's hot path (pause, begin, update, end, continue, flush) is a generator
that yields what it waits for and gets the answer back:

- an `HttpCall` (`EngineClient.prepare`): the call's answer is sent back, its EngineError
  thrown in;
- a `Future`: resumed once it is done;
- a `Blocking(fn)`: fn() run where it may block; its result sent back.

`drive(steps)` runs one on the calling thread (the blocking verbs of `EngineSession`);
`engine/call_pool.py` runs many at once on one thread, so a sync's calls to 64 engines do
not each take a pool thread.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from slime_like.engine.client import HttpCall

T = TypeVar("T")
#: what a verb yields, and what it returns
Steps = Generator[Any, Any, T]


class Blocking:
    """A step that may block (a read that is not on the hot path): run off the loop."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn


def drive(steps: Steps[T]) -> T:
    """Run a verb's steps on this thread, each call performed here."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            item = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            if isinstance(item, HttpCall):
                value = item.client.perform(item)
            elif isinstance(item, Future):
                wait_futures([item])
            elif isinstance(item, Blocking):
                value = item.fn()
            else:
                raise TypeError(f"a verb yielded {item!r}: an HttpCall, a Future or Blocking")
        except Exception as e:  # noqa: BLE001 - thrown into the verb, as a call would raise
            error = e
