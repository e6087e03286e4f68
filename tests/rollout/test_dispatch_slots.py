"""EngineSlots, admission dispatch's book of routed engines and their free slots, on its own
(the fleet and real engines: tests/fleet/test_admission_dispatch.py)."""

from __future__ import annotations

import asyncio

import pytest

from slime_like.rollout.dispatch import EngineSlots, NoEngineRouted


def test_requests_wait_for_a_free_slot_and_go_to_the_emptiest_engine():
    slots = EngineSlots("policy")
    slots.route("e0", "http://a:1", "key-a", 2)
    slots.route("e1", "http://b:1", None, 1)

    async def scenario():
        held = [await slots.acquire(5.0) for _ in range(3)]
        assert sorted(s.engine for s in held) == ["e0", "e0", "e1"]
        assert {s.engine: s.headers for s in held}["e0"] == {"Authorization": "Bearer key-a"}
        waiting = asyncio.ensure_future(slots.acquire(5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # every slot is held
        slots.release(held[2])     # e1's slot frees: the waiter gets it
        assert (await asyncio.wait_for(waiting, 2.0)).engine == "e1"

    asyncio.run(scenario())
    assert slots.in_flight() == {"e0": 2, "e1": 1}


def test_queue_places_only_once_every_engine_is_full_and_only_with_a_backlog():
    slots = EngineSlots(queue=1)
    slots.route("e0", "http://a:1", None, 2)
    slots.route("e1", "http://b:1", None, 1)

    async def scenario():
        held = [await slots.acquire(5.0) for _ in range(3)]   # every slot first
        assert sorted(s.engine for s in held) == ["e0", "e0", "e1"]
        later = [asyncio.ensure_future(slots.acquire(5.0)) for _ in range(4)]
        await asyncio.sleep(0.05)
        # a queue place each while two more wait behind (2 places in all); not the last two
        assert sorted(f.result().engine for f in later[:2]) == ["e0", "e1"]
        assert not any(f.done() for f in later[2:])
        assert slots.view("e0") == (3, 2, 2)
        queued_e1 = next(f.result() for f in later[:2] if f.result().engine == "e1")
        slots.release(held[2])     # e1's queued request takes the slot it freed
        await asyncio.sleep(0.05)
        assert not later[2].done()
        slots.release(queued_e1)   # a slot free: the next waiter takes it
        assert (await asyncio.wait_for(later[2], 2.0)).engine == "e1"
        slots.release(held[0])     # e0 at its slots again, and no backlog: no queue place
        await asyncio.sleep(0.05)
        assert not later[3].done()
        slots.release(held[1])     # a slot free: the last one takes it
        assert (await asyncio.wait_for(later[3], 2.0)).engine == "e0"

    asyncio.run(scenario())
    assert slots.in_flight() == {"e0": 2, "e1": 1}


def test_an_unrouted_engine_gets_nothing_and_keeps_its_count_until_routed_again():
    slots = EngineSlots()
    slots.route("e0", "http://a:1", None, 1)

    async def scenario():
        first = await slots.acquire(5.0)
        slots.unroute("e0")
        waiting = asyncio.ensure_future(slots.acquire(5.0))
        slots.release(first)       # freed on an unrouted engine: not handed out
        await asyncio.sleep(0.05)
        assert not waiting.done()
        slots.route("e1", "http://b:1", None, 1)   # a waiter is woken from another thread
        return (await asyncio.wait_for(waiting, 2.0)).engine

    assert asyncio.run(scenario()) == "e1"
    assert slots.routed() == ["e1"]


def test_a_waiter_that_gives_up_returns_a_slot_handed_to_it_meanwhile():
    slots = EngineSlots()
    slots.route("e0", "http://a:1", None, 1)

    async def scenario():
        held = await slots.acquire(5.0)
        waiting = asyncio.ensure_future(slots.acquire(5.0))
        await asyncio.sleep(0.01)
        slots.release(held)        # handed to the waiter ...
        waiting.cancel()           # ... which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert slots.in_flight() == {"e0": 0}


def test_no_engine_routed_for_the_bound_is_an_error():
    slots = EngineSlots("policy")
    with pytest.raises(NoEngineRouted, match="no engine of policy routed"):
        asyncio.run(slots.acquire(0.2))
