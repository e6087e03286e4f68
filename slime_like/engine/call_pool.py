"""Where and when the process's engine calls run: one thread pool, the engines' ordered
lanes, and one loop that sends the lanes' calls over kept connections.

- `engine_pool()`: the threads for calls that block (a probe, a group join, a call with no
  kept connection yet); the sessions and the smg RL plane (`rl_plane.py`) both use it, and
  the plane must not need the session module to do so.
- `OrderedLane`: one engine's calls, each sent once the one before it was sent and the
  futures it waits for are done. A queued call holds no thread while it waits: the futures'
  done-callbacks count its gates down, and the one that opens the last sends it. At 64
  engines a sync queues some 400 calls; a thread per queued call, each polling its gate,
  spent more of the trainer's CPU on waking and locking than on the calls themselves.
  `all_done` is the one gate many lanes wait on instead of each on every call.
- `EngineIoLoop`: one thread runs every lane call written as steps (`engine/steps.py`): it
  writes each request on a kept connection of its engine without blocking
  (`keepalive.send_nowait`), waits on all the sockets at once (`selectors`), feeds each
  answer to `httptools` as it arrives and resumes the call's steps with it. A thread per
  call made the trainer's CPU per call several times the call's own work (a thread woken
  per call, the GIL handed between hundreds of them). What the loop cannot do without
  blocking goes to the pool, and its outcome comes back to the loop: a call to an engine
  with no idle kept connection (it connects there, and the connection stays kept), an
  https engine, a large body, a `Blocking` step, a GET to retry. A call's timeout, a hung
  engine's `abort_waiting` and a broken connection fail it exactly as on a thread.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from httptools import HttpParserError

from slime_like.engine.client import HttpCall
from slime_like.engine.keepalive import InFlight, send_nowait
from slime_like.engine.steps import Blocking, Steps

log = logging.getLogger(__name__)

#: bodies above this are written by a pool thread (a bucket sent in the request itself)
LOOP_BODY_BYTES = 1 << 20

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOOP: EngineIoLoop | None = None


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


class CallCancelled(Exception):
    """A queued engine call that was never sent because the update had already failed."""


class _Queued:
    """A call in the lane: its future, its gates still closed, and whether it left."""

    __slots__ = ("after_prev", "args", "closed", "fn", "future", "generation", "next",
                 "prev", "sent", "steps")

    def __init__(self, fn: Callable, args: tuple, generation: int, prev: _Queued | None,
                 steps: bool):
        self.future: Future = Future()
        self.fn, self.args, self.steps = fn, args, steps
        self.generation = generation
        self.prev = prev
        self.next: _Queued | None = None
        self.closed = 1  # gates still closed; 1 until every callback is registered
        self.sent = False  # left the lane: handed to the pool, or failed unsent
        self.after_prev = False  # one of the gates is the previous call's leaving


class OrderedLane:
    """Calls sent in submission order, each behind its gates (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: _Queued | None = None
        self._generation = 0
        self._waiting: set[_Queued] = set()

    def submit(self, fn: Callable[..., Any], args: tuple,
               after: Sequence[Future] | None = None, steps: bool = False) -> Future:
        """Queue fn(*args): sent once the previous call was sent and every future in `after`
        is done (by default `after` is the previous call: it waits for its answer). With
        `steps`, fn(*args) is a call's steps (`engine/steps.py`), run by the engine-call
        loop (`engine/call_pool.py`); otherwise fn runs on a pool thread."""
        with self._lock:
            prev = self._last
            if after is None:
                after = () if prev is None else (prev.future,)
            queued = _Queued(fn, args, self._generation, prev, steps)
            if prev is not None and not prev.sent:
                prev.next = queued
                queued.after_prev = True
                queued.closed += 1
            queued.closed += len(after)
            self._last = queued
            self._waiting.add(queued)
        for future in after:
            future.add_done_callback(lambda _f, q=queued: self._open(q))
        self._open(queued)  # the registration gate
        return queued.future

    def tail(self) -> Future | None:
        with self._lock:
            return None if self._last is None else self._last.future

    def new_chain(self) -> None:
        with self._lock:
            self._last = None

    def cancel_pending(self) -> None:
        """Every call still waiting for a gate fails with CallCancelled, never sent."""
        fail_withdrawn(self.withdraw())

    def withdraw(self) -> list[_Queued]:
        """Keep every call still waiting for a gate from being sent (none is failed yet: a
        failure opens the gates of other lanes' calls waiting on it, so where several
        lanes are cancelled, all are withdrawn before any call fails)."""
        with self._lock:
            self._generation += 1
            self._last = None
            waiting, self._waiting = list(self._waiting), set()
            for queued in waiting:
                queued.sent = True
        return waiting

    def _open(self, queued: _Queued) -> None:
        """One gate of `queued` opened; the last one sends it, and may open the next's."""
        while queued is not None:
            with self._lock:
                queued.closed -= 1
                if queued.closed > 0 or queued.sent:
                    return
                queued.sent = True
                self._waiting.discard(queued)
                cancelled = queued.generation != self._generation
                nxt = queued.next if queued.next is not None and queued.next.after_prev else None
            self._send(queued, cancelled)
            queued = nxt  # its gate "the previous call left" is open now

    def _send(self, queued: _Queued, cancelled: bool) -> None:
        future, prev = queued.future, queued.prev
        queued.prev = None  # the chain is not kept alive behind the lane
        if cancelled:
            _fail(future, CallCancelled("not sent: the update had already failed"))
        elif prev is not None and prev.future.done() and prev.future.exception() is not None:
            # The chain broke: update k+1 must never reach an engine that did not take k.
            _fail(future, CallCancelled("not sent: the call before it failed"))
        elif queued.steps:
            io_loop().start(queued.fn, queued.args, future)
        else:
            engine_pool().submit(_run_call, future, queued.fn, queued.args)


def cancel_all(lanes: Iterable[OrderedLane]) -> None:
    """Cancel what waits in every lane, all withdrawn before any fails (`withdraw`): a sync's
    first update waits on every engine's begin, and one cancelled begin must not open it
    for lanes not yet cancelled."""
    withdrawn = [queued for lane in list(lanes) for queued in lane.withdraw()]
    fail_withdrawn(withdrawn)


def fail_withdrawn(withdrawn: Iterable[_Queued]) -> None:
    for queued in withdrawn:
        _fail(queued.future, CallCancelled("not sent: the update had already failed"))


def _run_call(future: Future, fn: Callable, args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return
    # When it was sent, answered, and how long its round trip took, for whoever times the
    # calls or picks the first failure.
    future.sent_at = time.perf_counter()  # type: ignore[attr-defined]
    try:
        result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        _finish(future, error=e)
        return
    _finish(future, result=result)


def _fail(future: Future, error: BaseException) -> None:
    future.answered_at = time.monotonic()  # type: ignore[attr-defined]
    future.set_exception(error)


def io_loop() -> EngineIoLoop:
    """The process's one engine-call loop (its thread starts with the first call)."""
    global _LOOP
    with _POOL_LOCK:
        if _LOOP is None or _LOOP.pid != os.getpid():  # a forked child has no loop thread
            _LOOP = EngineIoLoop()
        return _LOOP


class _Task:
    """One lane call: its steps, and the future its result goes to."""

    __slots__ = ("future", "steps")

    def __init__(self, steps: Steps, future: Future):
        self.steps, self.future = steps, future


class EngineIoLoop:
    """The loop's thread, its selector, and what other threads hand it."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._inbox: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._timers: list[tuple[float, int, InFlight]] = []
        self._seq = itertools.count()
        self._running = True
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="engine-io", daemon=True)
        self._thread.start()

    # ---- from any thread ----------------------------------------------------------------------

    def start(self, fn: Callable[..., Steps], args: tuple, future: Future) -> None:
        """Run fn(*args)'s steps on the loop; their result (or error) goes to `future`, with
        `sent_at`, `seconds` and `answered_at` set as a lane call's are."""
        self._post(self._begin, (fn, args, future))

    def _post(self, fn: Callable, args: tuple) -> None:
        self._inbox.append((fn, args))
        if threading.current_thread() is not self._thread:
            with contextlib.suppress(BlockingIOError):  # wake-ups pending already
                self._wake_w.send(b"\0")

    # ---- on the loop's thread -----------------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            while self._inbox:
                fn, args = self._inbox.popleft()
                try:
                    fn(*args)
                except Exception:  # noqa: BLE001 - the loop must outlive any one call
                    log.exception("engine-call loop: %s failed", getattr(fn, "__name__", fn))
            if not self._running:  # stopped by a posted halt: not back into select
                break
            timeout = None
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            for key, mask in self._selector.select(timeout):
                if key.data is None:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                try:
                    self._ready(key.data, mask)
                except Exception:  # noqa: BLE001
                    log.exception("engine-call loop: reading an answer failed")
            self._expire()

    def stop(self) -> None:
        """End the loop's thread once it is idle (a test that wants a fresh loop: `io_loop`
        makes a new one next); a call still in flight is failed."""
        def halt() -> None:
            self._running = False
        self._post(halt, ())
        self._thread.join(timeout=30)
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                self._end(key.data, ConnectionAbortedError("the engine-call loop stopped"))
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _begin(self, fn: Callable[..., Steps], args: tuple, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        future.sent_at = time.perf_counter()  # type: ignore[attr-defined]
        try:
            steps = fn(*args)
            # The first step runs here, in the frame that holds `fn`: what follows a call
            # handed to another thread (the architecture walk's tracer) finds it there.
            item = steps.send(None)
        except StopIteration as stop:
            _finish(future, result=stop.value)
            return
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            _finish(future, error=e)
            return
        self._take(_Task(steps, future), item)

    def _step(self, task: _Task, value: Any, error: BaseException | None) -> None:
        """Resume the task's steps with a result (or an error) and start what it yields."""
        try:
            item = task.steps.throw(error) if error is not None else task.steps.send(value)
        except StopIteration as stop:
            _finish(task.future, result=stop.value)
            return
        except BaseException as e:  # noqa: BLE001
            _finish(task.future, error=e)
            return
        self._take(task, item)

    def _take(self, task: _Task, item: Any) -> None:
        """Start what the steps yielded; its outcome resumes them."""
        if isinstance(item, HttpCall):
            self._send(task, item)
        elif isinstance(item, Future):
            item.add_done_callback(lambda _f: self._post(self._step, (task, None, None)))
        elif isinstance(item, Blocking):
            engine_pool().submit(self._off_loop, task, item.fn)
        else:
            self._step(task, None, TypeError(
                f"a verb yielded {item!r}: an HttpCall, a Future or Blocking"))

    def _off_loop(self, task: _Task, fn: Callable[[], Any]) -> None:
        """On a pool thread: fn(), its outcome back to the loop."""
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - thrown into the steps
            self._post(self._step, (task, None, e))
            return
        self._post(self._step, (task, value, None))

    def _send(self, task: _Task, call: HttpCall) -> None:
        """Write the request on an idle kept connection, or hand the call to a thread."""
        client = call.client
        flight = None
        if client.plain and (call.data is None or len(call.data) <= LOOP_BODY_BYTES):
            try:
                flight = send_nowait(client.kept, call, task)
            except Exception as e:  # noqa: BLE001 - the call's EngineError
                if call.method != "GET":
                    self._step(task, None, e)
                    return
                # a GET on a kept connection the engine had just closed: sent again
        if flight is None:
            engine_pool().submit(self._off_loop, task, lambda: client.perform(call))
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if flight.out else 0)
        self._selector.register(flight.sock, events, flight)
        heapq.heappush(self._timers, (time.monotonic() + call.timeout, next(self._seq), flight))

    def _ready(self, flight: InFlight, mask: int) -> None:
        if flight.done or flight.sock is None:
            return
        try:
            if mask & selectors.EVENT_WRITE and flight.writable():
                self._selector.modify(flight.sock, selectors.EVENT_READ, flight)
            if not mask & selectors.EVENT_READ or not flight.readable():
                return
        except BlockingIOError:
            return
        except (OSError, HttpParserError) as e:
            self._end(flight, e)
            return
        self._end(flight, None)

    def _compact_timers(self) -> None:
        """Drop the timers of answered calls once they are most of the heap (each stays
        queued until its deadline otherwise: a sync's timeout may be many minutes)."""
        live = len(self._selector.get_map())
        if len(self._timers) > 256 and len(self._timers) > 4 * live:
            self._timers = [t for t in self._timers if not t[2].done]
            heapq.heapify(self._timers)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            flight = heapq.heappop(self._timers)[2]
            if not flight.done:
                self._end(flight, TimeoutError("timed out"))

    def _end(self, flight: InFlight, error: BaseException | None) -> None:
        """The request answered (or failed): its connection kept or closed, its steps on."""
        task, call = flight.owner, flight.call
        assert isinstance(task, _Task) and isinstance(call, HttpCall)
        if flight.sock is not None:
            self._selector.unregister(flight.sock)
        try:
            status, text = flight.finish(error)
        except Exception as e:  # noqa: BLE001 - the call's EngineError, into its steps
            self._step(task, None, e)
            return
        finally:
            flight.release()  # its timer stays queued until its deadline: nothing heavy in it
            self._compact_timers()
        if call.method == "GET" and status in (502, 504):  # retried, with backoff, on a thread
            engine_pool().submit(self._off_loop, task, lambda: call.client.perform(call))
            return
        try:
            value = call.client.answer(call, status, text)
        except Exception as e:  # noqa: BLE001 - thrown into the steps
            self._step(task, None, e)
            return
        self._step(task, value, None)


def _finish(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """A sent call's outcome, with its round trip's seconds (on a thread or on the loop)."""
    future.seconds = time.perf_counter() - future.sent_at  # type: ignore[attr-defined]
    future.answered_at = time.monotonic()  # type: ignore[attr-defined]
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
