"""One call in an engine session's lane, and the gate that releases it.

A call leaves the lane once the call before it left and every future it waits for is done.
The gate counts those down with done-callbacks and hands the call to the engine pool when
the count reaches zero, so a gated call holds no thread and costs nothing while it waits.
(A pool thread blocked in `concurrent.futures.wait` per call took each future's lock and
a waiter every 50 ms: at 16 engines a sixth of the trainer's CPU in a sync, at 64 the
GIL the threads reading the answers needed.)

The callbacks are ours and only count and submit: nothing of a caller's runs on a lane.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from slime_like.engine.call_pool import engine_pool


class LaneCall:
    """A call in a session's lane: its future, whether it left the lane (sent, failed or
    cancelled), and the count of what it still waits for."""

    __slots__ = ("future", "generation", "_lock", "_left", "_left_lane", "_on_left",
                 "_released", "_run")

    def __init__(self, future: Future, generation: int):
        self.future = future
        self.generation = generation
        self._lock = threading.Lock()
        self._left = 0
        self._left_lane = False
        self._on_left: list[Callable[[], None]] = []
        self._released = False
        self._run: Callable[[LaneCall], None] | None = None

    # ---- the gate ----------------------------------------------------------------------------

    def arm(self, prev: LaneCall | None, after: Sequence[Future],
            run: Callable[[LaneCall], None]) -> None:
        """Submit `run(self)` to the engine pool once `prev` left the lane and every
        future of `after` is done (at once if they already are)."""
        self._run = run
        # + 1: held until every callback is registered (one may fire at once)
        self._left = len(after) + 1 + (prev is not None)
        if prev is not None:
            prev.when_left(self._one_done)
        for future in after:
            future.add_done_callback(self._one_future_done)  # at once if already done
        self._one_done()

    def _one_future_done(self, _: Future) -> None:
        self._one_done()

    def _one_done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left > 0 or self._released:
                return
            self._released = True
            run, self._run = self._run, None  # no chain of calls kept alive through it
        engine_pool().submit(run, self)

    def release_now(self) -> bool:
        """Take the call off its gate (a cancel); False if the gate already released it."""
        with self._lock:
            if self._released:
                return False
            self._released, self._run = True, None
            return True

    # ---- leaving the lane --------------------------------------------------------------------

    def when_left(self, callback: Callable[[], None]) -> None:
        """Call `callback` once this call left the lane (at once if it has)."""
        with self._lock:
            if not self._left_lane:
                self._on_left.append(callback)
                return
        callback()

    def mark_left(self) -> None:
        """The call left the lane: the next one may go once its own futures are done."""
        with self._lock:
            if self._left_lane:
                return
            self._left_lane = True
            callbacks, self._on_left = self._on_left, []
        for callback in callbacks:
            callback()

    @property
    def left_lane(self) -> bool:
        return self._left_lane
