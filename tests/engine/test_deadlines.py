"""A call type's deadline follows from the engines' answers: the cap until there is a basis,
then max(floor, factor x quantile), never above the cap; the policy is checked once."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from slime_like.config.deadlines import DeadlinePolicy
from slime_like.config.fleet_slices import HealthSettings
from slime_like.engine.address import EngineAddress
from slime_like.engine.deadlines import CallClock
from slime_like.engine.session import EngineSession
from slime_like.errors import ConfigError, WeightSyncError
from slime_like.weights.sync_config import WeightSyncConfig
from slime_like.weights.watch import EngineCall, Watch, call_type


def test_the_cap_until_enough_answers_then_the_floor_or_a_multiple_of_the_quantile():
    clock = CallClock(DeadlinePolicy(floor_s=1.0, factor=10, quantile=0.99, min_samples=4),
                      cap_s=30.0)
    for seconds in (0.001, 0.002, 0.003):
        clock.record("pause_generation", seconds)
    assert clock.deadline("pause_generation") == 30.0  # three answers: no basis yet
    clock.record("pause_generation", 0.004)
    assert clock.deadline("pause_generation") == 1.0  # 10 x 4 ms is below the floor
    for _ in range(4):
        clock.record("update_weights_from_distributed", 0.5)
    assert clock.deadline("update_weights_from_distributed") == 5.0  # each type its own
    clock.record("update_weights_from_distributed", 9.0)
    assert clock.deadline("update_weights_from_distributed") == 30.0  # never above the cap
    assert "quantile" in clock.basis("pause_generation")
    assert clock.deadline("end_weight_update") == 30.0  # never answered
    assert clock.snapshot() == {"pause_generation": 1.0}  # only the types with a basis


def test_a_window_forgets_old_answers():
    clock = CallClock(DeadlinePolicy(floor_s=0.1, factor=2, window=4, min_samples=4), cap_s=60)
    for seconds in (10.0, 1.0, 1.0, 1.0, 1.0):
        clock.record("begin_weight_update", seconds)
    assert clock.deadline("begin_weight_update") == 2.0  # the 10 s answer left the window


def test_a_bucket_update_is_one_call_type_whatever_its_bucket():
    assert call_type("update_weights_from_distributed (bucket 3/15)") == \
        "update_weights_from_distributed"
    assert call_type("pause_generation") == "pause_generation"


@pytest.mark.parametrize("fields", [{"floor_s": 0}, {"factor": 0.5}, {"quantile": 1.5},
                                    {"window": 0}, {"min_samples": 0},
                                    {"window": 4, "min_samples": 5}, {"typo_s": 1}])
def test_a_bad_policy_is_refused_naming_its_field(fields):
    with pytest.raises(ConfigError, match="deadlines"):
        DeadlinePolicy.of(fields)


def test_the_sync_and_the_health_settings_take_a_policy_or_its_fields():
    # a wrong verdict costs a resync in a sync the fleet settles; it fails a standalone
    # sync, and a probe's moves a busy engine's requests
    assert WeightSyncConfig(resume_on_failure=False).deadlines == DeadlinePolicy(floor_s=0.1)
    assert WeightSyncConfig().deadlines == DeadlinePolicy(floor_s=1.0)
    assert HealthSettings().deadlines == DeadlinePolicy(floor_s=1.0)
    config = WeightSyncConfig(deadlines={"floor_s": 0.5})
    assert config.deadlines == DeadlinePolicy(floor_s=0.5)
    with pytest.raises(ConfigError, match="deadlines.factor"):
        HealthSettings(deadlines={"factor": 0})


def _sent(url: str, step: str, seconds_ago: float) -> EngineCall:
    """A call as a lane leaves it once sent: its future carries `sent_at` (perf_counter).
    The answers' timing is set by hand: a broadcast that runs long on a loaded host is the
    fault, and it cannot be caused on cue with real engines."""
    future: Future = Future()
    future.sent_at = time.perf_counter() - seconds_ago  # type: ignore[attr-defined]
    return EngineCall(EngineSession(EngineAddress(url)), step, future)


def _answer(call: EngineCall) -> None:
    call.future.seconds = time.perf_counter() - call.future.sent_at  # type: ignore[attr-defined]
    call.future.set_result({"success": True})


def test_an_engine_is_late_only_once_it_lags_the_first_answer_of_its_step_by_the_deadline():
    # A bucket's receivers all finish when its broadcast does: on a loaded host the whole
    # step may run past the deadline, and an engine that answers just after its peers is
    # not hung (a CI run once cut one so, 0.39 s after send against a 0.37 s deadline).
    clock = CallClock(DeadlinePolicy(floor_s=0.5), cap_s=30.0)  # room for a stalled host
    step = "update_weights_from_distributed (bucket 1/1)"
    for _ in range(4):
        clock.record(call_type(step), 0.001)
    watch = Watch(30.0, clock)
    peer, slow = (watch.add(_sent(url, step, seconds_ago=2.0))
                  for url in ("http://127.0.0.1:1", "http://127.0.0.1:2"))
    _answer(peer)  # the broadcast ended 2 s after the send: 4x the deadline
    watch.check()  # the other receiver is not late: it lags its peer by nothing yet
    time.sleep(0.55)  # now it lags the step's first answer by more than the deadline
    with pytest.raises(WeightSyncError, match="after another engine answered") as err:
        watch.check()
    assert err.value.hung == [slow.engine.url]
