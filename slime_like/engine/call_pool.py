"""The process's one thread pool for engine calls.

Its own module because both the engine sessions and the smg RL plane (`rl_plane.py`) send
their calls on it, and the plane must not need the session module to do so.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def engine_pool() -> ThreadPoolExecutor:
    """The process's one pool for engine calls. Threads start lazily, so its size is only a
    ceiling: a waiting call holds a thread, and calls start in submission order, so the
    call a waiter waits for has always started before it."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(1024, thread_name_prefix="engine-call")
        return _POOL


def all_done(futures: Iterable[Future]) -> Future:
    """One future, done (result None) once every one of `futures` is done, whatever its
    outcome. Many lanes that wait for the same N calls wait on it instead of on the N:
    waiting on N futures takes each one's lock, so N lanes each waiting on all N made a
    sync's gate cost grow with the square of the fleet."""
    pending = list(futures)
    gate: Future = Future()
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            gate.set_result(None)

    if not pending:
        gate.set_result(None)
    for future in pending:
        future.add_done_callback(one_done)  # at once, here, for one already done
    return gate
