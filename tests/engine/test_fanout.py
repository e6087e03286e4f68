"""One call written as steps, fanned out to many engines on the engine-call loop."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from slime_like.engine.fanout import each_steps, on_all_steps
from slime_like.errors import WeightSyncError


@dataclass
class Engine:  # what a fan-out's failure reads of a session: its URL
    url: str


def _released_later(gates: list[Future], after_s: float = 0.1) -> None:
    timer = threading.Timer(after_s, lambda: [g.set_result(None) for g in gates])
    timer.start()


def test_steps_on_the_loop_keep_every_outcome_and_have_all_ended_on_return():
    gates = [Future() for _ in range(3)]
    ran_on: list[str] = []

    def steps(i: int):
        ran_on.append(threading.current_thread().name)
        yield gates[i]  # an engine's answer, later
        if i == 1:
            raise ValueError("engine 1 refused")
        return i * 10

    _released_later(gates)
    outcomes = each_steps([0, 1, 2], steps)
    assert [result for result, _ in outcomes] == [0, None, 20]
    assert isinstance(outcomes[1][1], ValueError) and outcomes[0][1] is outcomes[2][1] is None
    assert all(g.done() for g in gates)
    assert set(ran_on) == {"engine-io"}, "a thread per item, not the engine-call loop"


def test_one_item_runs_on_the_callers_thread():
    ran_on: list[str] = []

    def steps(_):
        ran_on.append(threading.current_thread().name)
        return "left"
        yield  # noqa: B901 - a generator: steps with nothing to wait for

    assert each_steps(["only"], steps) == [("left", None)]
    assert ran_on == [threading.current_thread().name]


def test_a_failure_is_raised_naming_the_engine_and_step_after_every_call_ended():
    engines = [Engine("http://e0"), Engine("http://e1"), Engine("http://e2")]
    gates = {e.url: Future() for e in engines}

    def leave(e: Engine):
        yield gates[e.url]
        if e.url == "http://e2":
            raise ValueError("no such group")
        return []

    _released_later(list(gates.values()))
    with pytest.raises(WeightSyncError, match="no such group") as caught:
        on_all_steps(engines, "destroy_weights_update_group", leave)
    assert caught.value.engine == "http://e2"
    assert caught.value.step == "destroy_weights_update_group"
    assert all(g.done() for g in gates.values())
