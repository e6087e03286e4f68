"""The lifecycle table: every legal move is allowed, every other move is refused; the
phases the fleet tells apart project onto the states its events name."""

from __future__ import annotations

import itertools
import pickle

import pytest

from slime_like.fleet.lifecycle import (
    ROUTED,
    TRANSITIONS,
    EngineState,
    IllegalTransition,
    ManagedEngine,
    Phase,
)

P, S = Phase, EngineState
DOWN = {P.DEAD, P.STOPPED}
# The moves the fleet relies on, written out independently of the table.
LEGAL = {(a, b) for a, bs in {
    P.LAUNCHING: {P.LOADED, *DOWN},
    P.LOADED: {P.UPDATING, P.STALE, P.DRAINING, *DOWN},
    P.UPDATING: {P.REGISTERED, P.STALE, P.SUSPECT, *DOWN},
    P.UPDATING_ROUTED: {P.REGISTERED, P.STALE, P.UPDATING, P.SUSPECT, *DOWN},
    P.REGISTERED: {P.UPDATING_ROUTED, P.SUSPECT, P.STALE, P.OFFLOADED, P.DRAINING, *DOWN},
    P.SUSPECT: {P.REGISTERED, P.STALE, P.DRAINING, *DOWN},
    P.OFFLOADED: {P.REGISTERED, P.STALE, P.AWAITING_SYNC, P.HELD, *DOWN},
    P.STALE: {P.UPDATING, P.DRAINING, *DOWN},
    P.AWAITING_SYNC: {P.UPDATING, P.STALE, P.DRAINING, *DOWN},
    P.HELD: {P.UPDATING, P.STALE, P.DRAINING, *DOWN},
    P.DEAD: {P.RELAUNCHING, P.REATTACHING, P.LOST, P.STOPPED},
    P.RELAUNCHING: {P.STALE, *DOWN},
    P.REATTACHING: {P.STALE, *DOWN},
    P.LOST: {P.STOPPED},
    P.DRAINING: {P.DRAINED, P.STOPPED},
    P.DRAINED: {P.STOPPED},
}.items() for b in bs}
# What the timeline shows: the state moves of docs/ARCHITECTURE.md's table.
PUBLIC = {
    (S.LAUNCHING, S.LOADED), (S.LAUNCHING, S.DEAD), (S.LAUNCHING, S.STOPPED),
    (S.LOADED, S.UPDATING), (S.LOADED, S.DEAD), (S.LOADED, S.STOPPED),
    (S.UPDATING, S.REGISTERED), (S.UPDATING, S.STALE), (S.UPDATING, S.DEAD),
    (S.UPDATING, S.STOPPED),
    (S.UPDATING, S.SUSPECT),  # a weight sync found it hung: resynced if it answers again
    (S.REGISTERED, S.UPDATING), (S.REGISTERED, S.SUSPECT), (S.REGISTERED, S.STALE),
    (S.REGISTERED, S.DEAD), (S.REGISTERED, S.STOPPED), (S.REGISTERED, S.OFFLOADED),
    (S.OFFLOADED, S.REGISTERED), (S.OFFLOADED, S.STALE), (S.OFFLOADED, S.DEAD),
    (S.OFFLOADED, S.STOPPED),
    (S.SUSPECT, S.REGISTERED), (S.SUSPECT, S.STALE), (S.SUSPECT, S.DEAD), (S.SUSPECT, S.STOPPED),
    (S.STALE, S.UPDATING), (S.STALE, S.DEAD), (S.STALE, S.STOPPED),
    (S.DEAD, S.RELAUNCHING), (S.DEAD, S.REATTACHING), (S.DEAD, S.STOPPED),
    (S.REATTACHING, S.STALE), (S.REATTACHING, S.DEAD), (S.REATTACHING, S.STOPPED),
    (S.RELAUNCHING, S.STALE), (S.RELAUNCHING, S.DEAD), (S.RELAUNCHING, S.STOPPED),
    # elastic membership: an added engine resyncs; a drained one leaves
    (S.LOADED, S.STALE), (S.LOADED, S.DRAINING), (S.REGISTERED, S.DRAINING),
    (S.SUSPECT, S.DRAINING), (S.STALE, S.DRAINING), (S.DRAINING, S.STOPPED),
}


def engine_in(phase: Phase) -> ManagedEngine:
    return ManagedEngine("m/g0/e0", "m", [], update_weights=True, phase=phase)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(P, P)),
                         ids=lambda s: s.value)
def test_every_move_is_allowed_exactly_when_the_table_says_so(src, dst):
    e = engine_in(src)
    if (src, dst) in LEGAL:
        assert e.move(dst) is src and e.phase is dst
    else:
        with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
            e.move(dst)
        assert e.phase is src  # a refused move changes nothing


def test_the_table_is_exactly_the_documented_moves():
    assert {(a, b) for a, bs in TRANSITIONS.items() for b in bs} == LEGAL


def test_the_phases_move_the_states_exactly_as_the_timeline_shows():
    """A move between phases of one state (a sync in place losing its router, the wait
    for a full sync ending, a recovery giving up) is no state change on the timeline."""
    assert {(a.state, b.state) for a, b in LEGAL if a.state is not b.state} == PUBLIC
    assert {p.state for p in P} == set(S)


def test_no_path_reaches_the_router_without_an_update():
    """A routed phase is entered only from UPDATING (a verified sync), SUSPECT (a probe
    hiccup of an engine that was already routed at the current version) or OFFLOADED (an
    engine routed at the current version whose memory came back; `move` rechecks it)."""
    assert {a for a, b in LEGAL if b in ROUTED and a not in ROUTED} == \
        {P.UPDATING, P.SUSPECT, P.OFFLOADED}


def test_an_external_engine_comes_back_only_through_a_sync():
    e = engine_in(P.REGISTERED)
    for phase in (P.DEAD, P.REATTACHING, P.STALE, P.UPDATING, P.REGISTERED):
        e.move(phase)
    with pytest.raises(IllegalTransition):
        engine_in(P.REATTACHING).move(P.REGISTERED)


def test_a_dead_engine_comes_back_only_through_a_sync_and_a_lost_one_never():
    path = [P.DEAD, P.RELAUNCHING, P.STALE, P.UPDATING, P.REGISTERED]
    e = engine_in(P.REGISTERED)
    for phase in path:
        e.move(phase)
    assert e.dead_at is not None
    assert TRANSITIONS[P.LOST] == {P.STOPPED}


def test_illegal_transition_crosses_ray_boundaries():
    err = pickle.loads(pickle.dumps(IllegalTransition("x", P.DEAD, P.REGISTERED)))
    assert err.src is P.DEAD and "DEAD -> REGISTERED" in str(err)


def test_an_engine_stopped_while_launching_says_it_never_served_and_why(tmp_path):
    """A run that fails during the launch stops engines still LAUNCHING: their STOPPED event
    says so and carries why (on a GPU run this read as a bare STOPPED <- LAUNCHING)."""
    from slime_like.cluster.placement import JobPlacement
    from slime_like.config.fleet_slices import fleet_settings
    from slime_like.config.parse import parse_args
    from slime_like.fleet.events import FleetEvent
    from slime_like.fleet.fleet import Fleet

    args = parse_args(["--config", "configs/quickstart.yaml"])
    events: list[FleetEvent] = []
    settings = fleet_settings(args, log_dir=str(tmp_path), model_paths={"default": "model"})
    fleet = Fleet(settings, JobPlacement(None, args.nominal_plan), on_event=events.append)
    fleet.shutdown(reason="the job failed (LaunchError: engine0: healthy but cannot generate)")
    assert [(e.subject, e.kind, e.previous) for e in events] == [
        (e.engine_id, S.STOPPED, S.LAUNCHING) for e in fleet.engines]
    assert all(e.details["reason"] == "the job failed (LaunchError: engine0: healthy but cannot "
               "generate) while it was launching: it never served" for e in events)


def test_a_drained_engine_never_comes_back_and_a_death_while_leaving_is_no_recovery():
    """DRAINING and DRAINED lead only to STOPPED: not DEAD (nothing relaunches an engine
    that is leaving), never a routed or syncable phase."""
    e = engine_in(P.REGISTERED)
    for phase in (P.DRAINING, P.DRAINED, P.STOPPED):
        e.move(phase)
    assert P.DEAD not in TRANSITIONS[P.DRAINING] | TRANSITIONS[P.DRAINED]
    assert P.DRAINED.state is S.DRAINING
