"""The lifecycle table: every legal move is allowed, every other move is refused."""

from __future__ import annotations

import itertools
import pickle

import pytest

from slime_like.fleet.lifecycle import TRANSITIONS, EngineState, IllegalTransition, ManagedEngine

S = EngineState
# The moves the fleet relies on, written out independently of the table.
LEGAL = {
    (S.LAUNCHING, S.LOADED), (S.LAUNCHING, S.DEAD), (S.LAUNCHING, S.STOPPED),
    (S.LOADED, S.UPDATING), (S.LOADED, S.DEAD), (S.LOADED, S.STOPPED),
    (S.UPDATING, S.REGISTERED), (S.UPDATING, S.STALE), (S.UPDATING, S.DEAD),
    (S.UPDATING, S.STOPPED),
    (S.REGISTERED, S.UPDATING), (S.REGISTERED, S.SUSPECT), (S.REGISTERED, S.STALE),
    (S.REGISTERED, S.DEAD), (S.REGISTERED, S.STOPPED), (S.REGISTERED, S.OFFLOADED),
    (S.OFFLOADED, S.REGISTERED), (S.OFFLOADED, S.STALE), (S.OFFLOADED, S.DEAD),
    (S.OFFLOADED, S.STOPPED),
    (S.SUSPECT, S.REGISTERED), (S.SUSPECT, S.STALE), (S.SUSPECT, S.DEAD), (S.SUSPECT, S.STOPPED),
    (S.STALE, S.UPDATING), (S.STALE, S.DEAD), (S.STALE, S.STOPPED),
    (S.DEAD, S.RELAUNCHING), (S.DEAD, S.REATTACHING), (S.DEAD, S.STOPPED),
    (S.REATTACHING, S.STALE), (S.REATTACHING, S.DEAD), (S.REATTACHING, S.STOPPED),
    (S.RELAUNCHING, S.STALE), (S.RELAUNCHING, S.DEAD), (S.RELAUNCHING, S.STOPPED),
}


def engine_in(state: EngineState) -> ManagedEngine:
    e = ManagedEngine("m/g0/e0", "m", [], update_weights=True)
    e.state = state
    return e


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(S, S)),
                         ids=lambda s: s.value)
def test_every_move_is_allowed_exactly_when_the_table_says_so(src, dst):
    e = engine_in(src)
    if (src, dst) in LEGAL:
        assert e.move(dst) is src and e.state is dst
    else:
        with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
            e.move(dst)
        assert e.state is src  # a refused move changes nothing


def test_the_table_is_exactly_the_documented_moves():
    assert {(a, b) for a, bs in TRANSITIONS.items() for b in bs} == LEGAL


def test_no_path_reaches_the_router_without_an_update():
    """REGISTERED (routed) is entered only from UPDATING (a verified sync), SUSPECT (a probe
    hiccup of an engine that was already routed at the current version) or OFFLOADED (an
    engine routed at the current version whose memory came back; `route()` rechecks it)."""
    assert {a for a, b in LEGAL if b is S.REGISTERED} == {S.UPDATING, S.SUSPECT, S.OFFLOADED}


def test_an_external_engine_comes_back_only_through_a_sync():
    e = engine_in(S.REGISTERED)
    for state in (S.DEAD, S.REATTACHING, S.STALE, S.UPDATING, S.REGISTERED):
        e.move(state)
    with pytest.raises(IllegalTransition):
        engine_in(S.REATTACHING).move(S.REGISTERED)


def test_a_dead_engine_comes_back_only_through_a_sync():
    path = [S.DEAD, S.RELAUNCHING, S.STALE, S.UPDATING, S.REGISTERED]
    e = engine_in(S.REGISTERED)
    for state in path:
        e.move(state)
    assert e.dead_at is not None


def test_illegal_transition_crosses_ray_boundaries():
    err = pickle.loads(pickle.dumps(IllegalTransition("x", S.DEAD, S.REGISTERED)))
    assert err.src is S.DEAD and "DEAD -> REGISTERED" in str(err)


def test_an_engine_stopped_while_launching_says_it_never_served_and_why(tmp_path):
    """A run that fails during the launch stops engines still LAUNCHING: their STOPPED event
    says so and carries why (on a GPU run this read as a bare STOPPED <- LAUNCHING)."""
    from slime_like.cluster.placement import JobPlacement
    from slime_like.config.parse import parse_args
    from slime_like.config.slices import fleet_settings
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
