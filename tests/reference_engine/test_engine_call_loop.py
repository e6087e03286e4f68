"""The engine-call loop (`engine/call_pool.py`), against a real engine.

A sync's lane calls written as steps run on the loop's one thread, over the engine's kept
connection; a call the engine does not answer fails as it would on a thread: at its
timeout, or at once when the hung engine's waiting calls are cut (`abort_waiting`), with
the engine's URL and the endpoint in the error. The hang is real: the engine's process
is stopped (SIGSTOP) and continued after.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.engine.steps import Blocking
from slime_like.errors import EngineError
from slime_like.protocol.modes import PauseMode


@contextlib.contextmanager
def stopped(proc) -> Iterator[None]:
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_steps_in_a_lane_run_on_the_loop_over_one_kept_connection(resumed):
    session = EngineSession(EngineAddress(resumed.url))
    threads: list[str] = []

    def pause(s: EngineSession):
        threads.append(threading.current_thread().name)
        loads = yield Blocking(s.loads)  # a step that may block runs off the loop
        assert "loads" in loads
        return (yield from s.pause_steps(PauseMode.RETRACT))

    for _ in range(10):
        session.submit_steps(pause, session)
        session.submit_steps(EngineSession.continue_steps, session).result(timeout=30)
    assert set(threads) == {"engine-io"}
    assert session.paused is None
    assert not resumed.get("/v1/loads").json()["loads"][0]["paused"]
    # pause and continue always found the connection kept by the call before them; only
    # the blocking reads, overlapping nothing, share it too
    assert session.http.connections_opened == 1


def test_a_call_on_the_loop_past_its_timeout_fails_naming_engine_and_endpoint(resumed):
    session = EngineSession(EngineAddress(resumed.url))
    session.submit_steps(EngineSession.continue_steps, session).result(timeout=30)  # kept
    with stopped(resumed.proc):
        t0 = time.monotonic()
        future = session.submit_steps(lambda s: s.pause_steps(PauseMode.RETRACT, timeout=0.5),
                                      session)
        with pytest.raises(EngineError) as err:
            future.result(timeout=30)
        took = time.monotonic() - t0
    assert err.value.url == resumed.url and err.value.endpoint == "/pause_generation"
    assert "timed out after 0.5s" in str(err.value)
    assert took < 10  # the call's own timeout, not the overall one (30 s)


def test_a_hung_engines_waiting_call_on_the_loop_is_cut_at_once(resumed):
    session = EngineSession(EngineAddress(resumed.url))
    session.submit_steps(EngineSession.continue_steps, session).result(timeout=30)
    with stopped(resumed.proc):
        future = session.submit_steps(lambda s: s.pause_steps(PauseMode.RETRACT, timeout=60),
                                      session)
        deadline = time.monotonic() + 10
        while not session.http.kept._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert session.abort_waiting() == 1
        with pytest.raises(EngineError) as err:
            future.result(timeout=10)
    assert err.value.url == resumed.url and err.value.reason == "connection failed"
    # the next call opens a fresh connection and is answered
    assert session.continue_generation(timeout=30) is not None


def test_a_stopped_loop_ends_its_thread_with_answered_calls_timers_still_queued(resumed):
    """`stop` (how tests get a fresh loop) ends the thread even while an answered call's
    timer (here 60 s) is the next thing the loop would wait for."""
    from slime_like.engine import call_pool

    session = EngineSession(EngineAddress(resumed.url))
    session.submit_steps(lambda s: s.pause_steps(PauseMode.RETRACT, timeout=60),
                         session).result(timeout=30)
    session.submit_steps(EngineSession.continue_steps, session).result(timeout=30)
    loop = call_pool.io_loop()
    assert loop._timers  # the answered calls' timers wait for their deadlines
    try:
        loop.stop()
        assert not loop._thread.is_alive()
    finally:
        call_pool._LOOP = None  # the next call makes a new loop
    session.submit_steps(EngineSession.continue_steps, session).result(timeout=30)
