"""The process's one thread pool for engine calls.

Its own module because both the engine sessions and the smg RL plane (`rl_plane.py`) send
their calls on it, and the plane must not need the session module to do so.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

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
