"""`all_done`: the one gate many engine lanes wait on instead of every call's future."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from slime_like.engine.call_pool import all_done, engine_pool
from slime_like.engine.session import CallCancelled


def test_the_gate_opens_only_once_every_call_is_done_whatever_its_outcome():
    calls = [Future() for _ in range(3)]
    gate = all_done(calls)
    calls[0].set_result({"success": True})
    calls[1].set_exception(CallCancelled("not sent"))
    assert not gate.done()
    calls[2].cancel()
    assert gate.done() and gate.result() is None


def test_calls_already_done_and_no_calls_open_it_at_once():
    done = Future()
    done.set_result(None)
    assert all_done([done]).done()
    assert all_done([]).done()


def test_lanes_on_the_pool_wait_on_one_gate_for_calls_answered_on_other_threads():
    """As a sync's first update: every lane waits for every engine's pause and begin."""
    calls = [Future() for _ in range(32)]
    gate = all_done(calls)
    released = []
    lock = threading.Lock()

    def lane(i: int) -> None:
        gate.result(timeout=30)
        with lock:
            released.append(i)

    lanes = [engine_pool().submit(lane, i) for i in range(16)]
    answerers = [threading.Thread(target=f.set_result, args=(None,)) for f in calls[:-1]]
    for t in answerers:
        t.start()
    for t in answerers:
        t.join()
    assert released == []  # one call still unanswered holds every lane
    calls[-1].set_result(None)
    for f in lanes:
        f.result(timeout=30)
    assert sorted(released) == list(range(16))


# ---- OrderedLane: a queued call holds no thread, and leaves in order -------------------------

def _pool_threads() -> int:
    return sum(t.name.startswith("engine-call") for t in threading.enumerate())


def test_a_lane_sends_in_order_each_call_after_its_gates_without_a_thread_waiting():
    from slime_like.engine.call_pool import OrderedLane

    lane, gate, sent = OrderedLane(), Future(), []
    first = lane.submit(sent.append, ("pause",))
    before = _pool_threads()
    # 40 calls behind a gate nobody opened yet: none is sent, none holds a thread
    queued = [lane.submit(sent.append, (f"update {i}",), after=[gate] if i == 0 else None)
              for i in range(40)]
    first.result(timeout=30)
    assert sent == ["pause"] and not any(f.done() for f in queued)
    assert _pool_threads() <= before + 1
    gate.set_result(None)
    queued[-1].result(timeout=30)
    assert sent == ["pause", *(f"update {i}" for i in range(40))]


def test_a_lane_cancels_what_waits_at_once_and_breaks_the_chain_behind_a_failure():
    from slime_like.engine.call_pool import OrderedLane

    lane, gate = OrderedLane(), Future()
    waiting = [lane.submit(print, ("never",), after=[gate]) for _ in range(3)]
    lane.cancel_pending()  # no gate needed to open for the waiting calls to fail
    for f in waiting:
        assert isinstance(f.exception(timeout=1), CallCancelled)
    gate.set_result(None)  # opening it later sends none of them

    def refuse() -> None:
        raise RuntimeError("refused")

    lane.new_chain()
    failed = lane.submit(refuse, ())
    behind = lane.submit(print, ("not sent",))
    assert isinstance(failed.exception(timeout=30), RuntimeError)
    err = behind.exception(timeout=30)
    assert isinstance(err, CallCancelled) and "the call before it failed" in str(err)


def test_cancelling_many_lanes_sends_nothing_a_cancelled_call_held_back():
    """As a failed sync: B's first update waits on A's begin (whatever its outcome); A's
    begin is cancelled, and B's update must not go out on its way."""
    from slime_like.engine.call_pool import OrderedLane, all_done, cancel_all

    a, b, never = OrderedLane(), OrderedLane(), Future()
    begin = a.submit(print, ("begin",), after=[never])
    ran = []
    update = b.submit(ran.append, ("update",), after=[all_done([begin])])
    cancel_all([a, b])
    for f in (begin, update):
        assert isinstance(f.exception(timeout=5), CallCancelled)
    engine_pool().submit(lambda: None).result(timeout=5)  # anything handed over has run
    assert ran == []
