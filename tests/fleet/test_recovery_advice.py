"""The recovery's advice: what a dead or STALE engine needs next, from its phase alone.

A user relies on the outcome: an engine that dies comes back (relaunched, or waited for if
it is someone else's), one that keeps dying or never reaches the fleet's version is given
up rather than retried forever, and no resync races a full sync for the same engine.
"""

from __future__ import annotations

import time
from dataclasses import replace

from slime_like.config.fleet_slices import HealthSettings
from slime_like.fleet.launcher import LIVENESS_TIMEOUT_S
from slime_like.fleet.lifecycle import ManagedEngine, Phase
from slime_like.fleet.recovery import MAX_RECOVERY_ATTEMPTS, Recovery, Step, Tending

P = Phase


def engine(phase: Phase, *, external: bool = False, frozen: bool = False) -> ManagedEngine:
    return ManagedEngine("m/g0/e0", "m", [], update_weights=not frozen, phase=phase,
                         external_address="http://10.0.0.9:30000" if external else None)


def advice(t: Tending, *, closing: bool = False, syncing: bool = False) -> Step:
    return Recovery.next_step(t, closing=closing, syncing=syncing)


def test_a_dead_engine_is_relaunched_and_an_external_one_waited_for():
    assert advice(Tending(engine(P.DEAD), "exited")) is Step.RELAUNCH
    assert advice(Tending(engine(P.DEAD, external=True), "exited")) is Step.REATTACH


def test_one_that_keeps_dying_is_relaunched_again_then_given_up():
    t = Tending(engine(P.DEAD), "exited")
    for _ in range(MAX_RECOVERY_ATTEMPTS):
        assert advice(t) is Step.RELAUNCH
        t.engine.phase = P.STALE   # relaunched ...
        t.back()
        t.engine.phase = P.DEAD    # ... and dead again before it was resynced
    assert advice(t) is Step.GIVE_UP


def test_a_relaunched_engine_waits_for_a_full_sync_then_resyncs_and_is_recovered():
    t = Tending(engine(P.STALE), "exited")
    assert advice(t, syncing=True) is Step.WAIT
    assert advice(t) is Step.RESYNC
    t.engine.phase = P.UPDATING  # a full sync took it along
    assert advice(t) is Step.WAIT
    t.engine.phase = P.REGISTERED
    assert advice(t) is Step.RECOVERED


def test_a_frozen_models_engine_is_routed_as_loaded():
    assert advice(Tending(engine(P.STALE, frozen=True), "exited")) is Step.ROUTE_FROZEN


def test_a_stale_engine_not_at_the_version_in_time_is_given_up_or_left_to_a_full_sync():
    recovery, resync = Tending(engine(P.STALE), "exited"), Tending(engine(P.STALE))
    for t in (recovery, resync):
        t.deadline = time.monotonic() - 1
    assert advice(recovery) is Step.GIVE_UP
    assert advice(resync) is Step.LEAVE


def test_a_death_during_a_resync_makes_it_a_recovery():
    t = Tending(engine(P.STALE))
    assert not t.is_recovery
    t.engine.phase = P.DEAD
    t.died("exited")
    assert t.is_recovery and advice(t) is Step.RELAUNCH


def test_an_engine_waiting_for_the_next_full_sync_gets_no_resync_of_its_own():
    for phase in (P.AWAITING_SYNC, P.HELD):
        assert advice(Tending(engine(phase))) is Step.LEAVE
        assert advice(Tending(engine(phase), "exited")) is Step.WAIT


def test_nothing_is_tended_while_the_fleet_closes():
    assert advice(Tending(engine(P.DEAD), "exited"), closing=True) is Step.LEAVE


def test_an_engine_a_sync_found_hung_is_probed_until_it_answers_or_called_dead_in_time():
    """SUSPECT from a sync: probed (not relaunched) while its answer is waited for; once
    it answers it is STALE and resynced; no answer and no verdict by then: dead after all.
    A suspect of the health monitor's own is the monitor's to judge."""
    t = Tending(engine(P.SUSPECT), answer_by=time.monotonic() + 60)
    assert advice(t) is Step.PROBE and advice(t, syncing=True) is Step.PROBE
    t.engine.phase = P.STALE  # it answered
    assert advice(t) is Step.RESYNC
    late = Tending(engine(P.SUSPECT), answer_by=time.monotonic() - 1)
    assert advice(late) is Step.CALL_DEAD
    late.engine.phase = P.DEAD  # the monitor, or the tending, called it dead
    late.died("2 consecutive failed probes")
    assert advice(late) is Step.RELAUNCH
    assert advice(Tending(engine(P.SUSPECT))) is Step.LEAVE


def test_a_hung_engine_waits_past_the_monitors_budget_or_alone_for_that_budget():
    """The monitor's verdict comes first while it runs: its rounds may each wait for the
    actors' liveness and then a probe's timeout."""
    watched = HealthSettings(enabled=True, interval_s=1, timeout_s=10, failure_threshold=2)
    one_round = watched.interval_s + LIVENESS_TIMEOUT_S + watched.timeout_s
    assert Recovery.answer_wait_s(watched) > 2 * watched.failure_threshold * one_round
    alone = HealthSettings(enabled=False)
    assert alone.failure_threshold * (alone.interval_s + alone.timeout_s) < \
        Recovery.answer_wait_s(alone) < Recovery.answer_wait_s(replace(alone, enabled=True))
