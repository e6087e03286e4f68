"""Engine busy/idle/down sampled from real reference engines (an idle one blamed on what the
client says it holds); trainer phases on a fake clock."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.observe.idle_causes import (
    NO_REQUEST,
    PRODUCER_WINDOW,
    ROUND_TRIP,
    SYNC_EDGE,
    ClientView,
)
from slime_like.observe.utilization import (
    BUSY,
    DOWN,
    IDLE,
    PAUSED,
    EngineUtilization,
    RunUtilization,
    TrainerUtilization,
    UtilizationLog,
    read_utilization,
    run_idle_ratios,
)
from slime_like.reference_engine.step_floor import MIN_STEP_ENV
from tests.reference_engine.conftest import start_engine, stop_engine, wait_until_healthy


def _wait_for(what: str, condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def two_engines(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("utilization-engines")
    # Steps of at least 5 ms: the long generation lasts seconds, not the tiny model's one
    # second, so the 50 ms sampler sees it busy on a loaded machine too.
    engines = [start_engine(tiny_model_dir, log_dir, "--max-running-requests", "4",
                            env={MIN_STEP_ENV: "5"}, wait_healthy=False) for _ in range(2)]
    try:
        for e in engines:
            wait_until_healthy(e)
        yield engines
    finally:
        for e in engines:
            stop_engine(e)


def test_engines_idle_then_busy_during_a_generation_and_down_once_killed(two_engines, tmp_path):
    e0, e1 = two_engines
    watched = [EngineSession(EngineAddress(e0.url, engine_id="e0"))]
    begun = time.time()
    log = UtilizationLog(tmp_path / "utilization.jsonl", origin=begun)
    client = {"e0": ClientView(producer_full=True)}  # what the rollout client holds
    util = EngineUtilization(lambda: list(watched), interval_s=0.05, log=log,
                             client=client.get).start()
    try:
        _wait_for("a few polls", lambda: util.polls >= 5)
        quiet_until = time.time()
        assert util.state_of("e0") == IDLE
        assert util.idle_ratio(begun, quiet_until) == 1.0
        assert {iv.cause for iv in util.intervals(engine="e0")} == {PRODUCER_WINDOW}
        client["e0"] = ClientView()  # the client has nothing at all for it

        # Paused for a sync: not busy, and counted as idle time.
        watched[0].pause_generation("retract", timeout=10)
        try:
            _wait_for("e0 paused", lambda: util.state_of("e0") == PAUSED)
        finally:
            watched[0].continue_generation(timeout=10)
        _wait_for("e0 idle after continue", lambda: util.state_of("e0") == IDLE)
        _wait_for("a poll after the resume", lambda: util.intervals(engine="e0")[-1].cause
                  == NO_REQUEST)
        after_pause = [iv.cause for iv in util.intervals(engine="e0")][-2:]
        assert after_pause == [SYNC_EDGE, NO_REQUEST]  # the first idle poll after a resume
        client["e0"] = ClientView(bound=1)  # a request bound to it but not running there
        _wait_for("e0 idle on a round trip", lambda: util.intervals(engine="e0")[-1].cause
                  == ROUND_TRIP)

        # One long generation: the engine is busy while it runs, idle again after.
        out: dict = {}
        sent = time.time()
        worker = threading.Thread(target=lambda: out.update(r=e0.generate(
            {"text": "a", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True,
                                              "temperature": 0}}, timeout=120)))
        worker.start()
        _wait_for("e0 busy", lambda: util.state_of("e0") == BUSY)
        worker.join(120)
        answered = time.time()
        assert out["r"].status_code == 200
        _wait_for("e0 idle again", lambda: util.state_of("e0") == IDLE)
        busy = [iv for iv in util.intervals(engine="e0") if iv.state == BUSY]
        assert busy and busy[0].start >= sent and busy[0].start < answered
        assert busy[0].fill == 0.25  # one request running in 4 slots
        during = util.idle_ratio(sent, answered)
        assert during is not None and during < 1.0
        assert 0.0 < util.idle_ratio(begun, time.time()) < 1.0

        # A second engine joins the set, then is killed: down, not idle, and left out of
        # the idle ratio.
        watched.append(EngineSession(EngineAddress(e1.url, engine_id="e1")))
        _wait_for("e1 seen idle", lambda: util.state_of("e1") == IDLE)
        os.killpg(e1.proc.pid, signal.SIGKILL)
        _wait_for("e1 down", lambda: util.state_of("e1") == DOWN)
        down_from = time.time()
        polls = util.polls
        _wait_for("polls after the death", lambda: util.polls >= polls + 3)
        after = time.time()
        assert util.idle_ratio(down_from, after, engine="e1") is None
        assert util.idle_ratio(down_from, after) == util.idle_ratio(down_from, after, "e0") == 1.0
        assert util.state_of("e0") == IDLE  # one engine down does not hide the others

        watched.pop()  # the fleet stops listing it: its interval closes
        _wait_for("e1 gone", lambda: util.state_of("e1") is None)
    finally:
        util.stop()
    assert not util._thread.is_alive()
    rows = read_utilization(tmp_path / "utilization.jsonl")["engine"]
    states = {(r["subject"], r["state"]) for r in rows}
    assert {("e0", IDLE), ("e0", BUSY), ("e1", IDLE), ("e1", DOWN)} <= states
    assert {r.get("cause") for r in rows if r["subject"] == "e0" and r["state"] == IDLE} \
        == {PRODUCER_WINDOW, SYNC_EDGE, NO_REQUEST, ROUND_TRIP}
    assert all(r["end_s"] > r["start_s"] >= 0 for r in rows)


def test_a_failing_engine_set_or_stopped_engine_never_raises_into_the_job():
    def broken():
        raise RuntimeError("fleet lock poisoned")

    util = EngineUtilization(broken, interval_s=0.01)
    util.poll_once()  # no exception
    util.start()
    time.sleep(0.05)
    util.stop()
    assert not util._thread.is_alive() and util.intervals() == []

    # Nothing listens there: after `down_after` failed polls it is down, from the first.
    port_free = EngineSession(EngineAddress("http://127.0.0.1:9"))  # named by the mapping below
    clock = iter(float(t) for t in range(100))
    util = EngineUtilization(lambda: {"nowhere": port_free}, interval_s=0.01, timeout_s=0.2,
                             down_after=3, clock=lambda: next(clock))
    for _ in range(2):
        util.poll_once()
    assert util.state_of("nowhere") is None  # two misses are not yet a death
    util.poll_once()
    util.poll_once()
    util.stop()
    (down,) = util.intervals()
    assert (down.state, down.start, down.end) == (DOWN, 0.0, 3.0)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trainer_idle_ratio_counts_time_outside_busy_phases_once():
    clock = FakeClock()
    trainer = TrainerUtilization(clock=clock)
    with trainer.busy("train"):
        clock.now += 3.0
    clock.now += 1.0  # idle 104..105
    with contextlib.suppress(ValueError), trainer.busy("sync"):
        clock.now += 1.0
        raise ValueError("a failed sync is still time spent")
    trainer.record("logprobs", 104.5, 105.5)  # overlaps the sync: counted once
    assert trainer.idle_ratio(100.0, 110.0) == pytest.approx(0.55)  # busy 100..103, 104..105.5
    assert trainer.idle_ratio(103.0, 104.0) == pytest.approx(1.0)
    assert trainer.idle_ratio(100.0, 103.0) == 0.0
    assert [p.state for p in trainer.phases()] == ["train", "sync", "logprobs"]


def test_run_utilization_writes_syncs_and_trainer_phases_for_the_report(tmp_path):
    clock = FakeClock()
    util = RunUtilization(lambda: [], tmp_path, origin=90.0, clock=clock)
    with util.trainer.busy("train"):
        clock.now += 2.0
    util.record_sync(102.0, 102.5, version=3)
    clock.now = 110.0
    assert util.step_metrics(100.0) == {"trainer_idle_ratio": 0.8}  # no engine observed
    assert util.step_metrics(100.0, 105.0, samples=20) == {"trainer_idle_ratio": 0.6,
                                                            "samples_per_s": 4.0}
    rows = read_utilization(tmp_path / "utilization.jsonl")
    assert rows["sync"] == [{"kind": "sync", "version": "3", "start_s": 12.0, "end_s": 12.5}]
    assert rows["trainer"][0]["state"] == "train"
    rows["engine"] = [{"subject": "e0", "state": BUSY, "start_s": 10.0, "end_s": 13.0},
                      {"subject": "e0", "state": IDLE, "start_s": 13.0, "end_s": 14.0},
                      {"subject": "e0", "state": DOWN, "start_s": 14.0, "end_s": 20.0}]
    ratios = run_idle_ratios(rows)
    assert ratios["engine_idle_ratio"] == 0.25
    assert ratios["trainer_idle_ratio"] == pytest.approx(0.8)  # 2 s busy of 10.0..20.0


def test_observers_start_the_sampler_and_close_stops_it_before_the_report(tmp_path):
    from slime_like.config.parse import parse_args
    from slime_like.config.slices import observe_settings
    from slime_like.observe import RunObservers

    args = parse_args(["--config", "configs/quickstart.yaml", "--num-rollout", "1",
                       "--output-dir", str(tmp_path)])
    obs = RunObservers.start(observe_settings(args), tmp_path)
    unreachable = EngineSession(EngineAddress("http://127.0.0.1:9", engine_id="e0"))
    util = obs.start_utilization(lambda: [unreachable], interval_s=0.02)
    assert obs.start_utilization(lambda: []) is util  # one sampler per run
    begun = time.time()
    with util.trainer.busy("train"):
        _wait_for("e0 down", lambda: util.engines.state_of("e0") == DOWN)
    util.record_sync(time.time(), time.time() + 0.01, version=1)
    obs.log_step(0, {"reward_mean": 0.5, "async_mode": "one-step",
                     **util.step_metrics(begun), "staleness": {0: 3, 1: 1}})
    text = obs.close("async run").read_text()
    assert not util.engines._thread.is_alive()
    assert "- schedule: one-step" in text and "(utilization.png)" in text
    # e0 never answered: no engine time was observed, so there is no engine ratio.
    assert "idle over the run: engines n/a" in text
    rows = read_utilization(tmp_path / "utilization.jsonl")
    assert [r["state"] for r in rows["engine"]] == [DOWN] and len(rows["sync"]) == 1
