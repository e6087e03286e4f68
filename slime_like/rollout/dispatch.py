"""Admission dispatch (`--rollout-dispatch admission`): a request is bound to an engine only
when that engine has a free slot.

A router binds a request to an engine when it is sent: round-robin spreads a step's
requests evenly, so an engine whose requests happened to be short empties its queue and
idles while another still works through its own; a load-aware router reads loads up to a
poll old and sends bursts to the engine that looked emptiest. Here the rollout client keeps
its requests itself and gives one to an engine the moment that engine has a slot free: an
engine's slots are its `max_running_requests` (sglang's `/v1/loads`), and the client knows
how many of them its own requests hold. Requests that find no free slot wait in the client,
first come first served, and go straight to the engine's URL with its API key.

A slot freed on an engine would stay empty for one round trip through the client (the
answer back, the next request bound and sent), and the tiny model's requests, all of one
length, free their slots in the same step: the engine then runs nothing for that round
trip. With `queue` > 0 each engine is also given up to that many requests beyond its
slots, as sglang queues what exceeds `max_running_requests`: they wait in the engine's own
queue and take a freed slot at its next step. A request is queued only when no routed
engine has a slot free, so no engine queues what another could run now, and only while at
least as many requests wait behind it in the client as there are queue places in all: at a
rollout's tail nothing is left to refill a slot freed elsewhere. Off by default: a queued
request waits for its engine's next slot instead of the first slot freed on any engine,
which with 4 engines cost more than the round trip it saved (docs/ASYNC.md).

The router still owns everything else: health, registration, the fleet's routing
invariant. `EngineSlots` holds exactly the engines the fleet has in the router: the
fleet's `Routers` adds an engine here after the router lists it and takes it out here
before it leaves the router, so no request is bound to an engine the fleet unrouted (one
already running there ends there, as through a router). An engine's count of requests in
flight outlives its unrouting, so one routed again is never given more than its free slots
(and queue places).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One free slot of one engine, held by one request until it is released."""

    engine: str               # the fleet's engine id
    url: str
    headers: dict[str, str]   # the engine's API key, if it has one


@dataclass
class _Engine:
    url: str
    api_key: str | None
    slots: int
    in_flight: int = 0
    routed: bool = True

    @property
    def free(self) -> int:
        """Slots no request of ours holds (below 0 while some wait in its queue)."""
        return self.slots - self.in_flight


class NoEngineRouted(RuntimeError):
    """No engine was routed for longer than the client waits for one."""


class EngineSlots:
    """The routed engines of one model and the slots this process's requests hold on each.

    Thread-safe: the fleet routes and unroutes from its own threads, and each generator
    waits for slots on its own event loop (a waiter is woken on its loop).
    """

    def __init__(self, model: str = "", queue: int = 0):
        if queue < 0:
            raise ValueError(f"EngineSlots({model!r}): queue must be >= 0, got {queue}")
        self.model = model
        self.queue = queue  # requests bound to an engine beyond its slots (its own queue)
        self._lock = threading.Lock()
        self._engines: dict[str, _Engine] = {}
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self.bound: dict[str, int] = {}   # engine id -> requests bound to it so far

    # ---- the fleet's side ---------------------------------------------------------------------

    def knows(self, engine: str, url: str) -> bool:
        """Whether the engine's slots are known already (from an earlier routing)."""
        with self._lock:
            known = self._engines.get(engine)
            return known is not None and known.url == url

    def route(self, engine: str, url: str, api_key: str | None, slots: int | None) -> None:
        """Requests may be bound to the engine now; `slots` None keeps the known count."""
        with self._lock:
            known = self._engines.get(engine)
            if known is not None and known.url == url:
                known.routed = True
                known.api_key = api_key
                known.slots = known.slots if slots is None else slots
            else:  # new, or relaunched at another address: nothing of ours runs there
                if slots is None or slots < 1:
                    raise ValueError(f"engine {engine} ({url}): slots must be >= 1, got {slots}")
                self._engines[engine] = _Engine(url.rstrip("/"), api_key, slots)
            self._hand_out()

    def unroute(self, engine: str) -> None:
        """No request is bound to the engine from now on (those running there go on)."""
        with self._lock:
            known = self._engines.get(engine)
            if known is not None:
                known.routed = False

    def routed(self) -> list[str]:
        with self._lock:
            return [k for k, e in self._engines.items() if e.routed]

    def in_flight(self) -> dict[str, int]:
        """Requests of this process running on (or sent to) each engine."""
        with self._lock:
            return {k: e.in_flight for k, e in self._engines.items()}

    def view(self, engine: str) -> tuple[int, int, int] | None:
        """(requests bound to the engine, its slots, requests waiting in the client for a
        slot) now, or None for an engine never routed: what an idle engine is blamed on."""
        with self._lock:
            known = self._engines.get(engine)
            waiting = sum(1 for _, fut in self._waiters if not fut.done())
            return None if known is None else (known.in_flight, known.slots, waiting)

    # ---- the client's side --------------------------------------------------------------------

    async def acquire(self, no_engine_s: float) -> Slot:
        """A free slot (waits for one, first come first served). `NoEngineRouted` once no
        engine at all has been routed for `no_engine_s` seconds."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters:
                slot = self._take(behind=0)
                if slot is not None:
                    return slot
            fut: asyncio.Future = loop.create_future()
            self._waiters.append((loop, fut))
            self._hand_out()  # a slot may be free behind waiters that just gave up
        none_since: float | None = None
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=min(1.0, no_engine_s / 2))
                if done:
                    return fut.result()
                if self.routed():
                    none_since = None
                    continue
                none_since = none_since or time.monotonic()
                if time.monotonic() - none_since >= no_engine_s:
                    raise NoEngineRouted(f"no engine of {self.model or 'the model'} routed for "
                                         f"{no_engine_s:.0f} s")
        except BaseException:
            with self._lock:
                if (loop, fut) in self._waiters:
                    self._waiters.remove((loop, fut))
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed a slot just as it gave up
            fut.cancel()
            raise

    def release(self, slot: Slot) -> None:
        """The request holding `slot` ended (answered, failed or cancelled)."""
        with self._lock:
            known = self._engines.get(slot.engine)
            if known is not None and known.url == slot.url and known.in_flight > 0:
                known.in_flight -= 1
            self._hand_out()

    # ---- under the lock -----------------------------------------------------------------------

    def _take(self, behind: int) -> Slot | None:
        """A slot of the routed engine with the most free slots; when none has one and
        `behind` (requests waiting after this one) covers every queue place, a place in
        the queue of the one with the most room there; else None."""
        routed = [(k, e) for k, e in self._engines.items() if e.routed]
        best = max(routed, key=lambda kv: kv[1].free, default=None)
        if best is None or best[1].free + self.queue <= 0:
            return None
        if best[1].free <= 0 and behind < self.queue * len(routed):
            return None  # no backlog to refill a slot freed elsewhere: wait for a slot
        engine, e = best
        e.in_flight += 1
        self.bound[engine] = self.bound.get(engine, 0) + 1
        headers = {"Authorization": f"Bearer {e.api_key}"} if e.api_key else {}
        return Slot(engine, e.url, headers)

    def _hand_out(self) -> None:
        while self._waiters:
            loop, fut = self._waiters[0]
            if fut.done():  # gave up
                self._waiters.popleft()
                continue
            slot = self._take(behind=len(self._waiters) - 1)
            if slot is None:
                return
            self._waiters.popleft()
            try:
                loop.call_soon_threadsafe(self._deliver, fut, slot)
            except RuntimeError:  # its loop closed: the slot goes back
                self._engines[slot.engine].in_flight -= 1
                self.bound[slot.engine] -= 1

    def _deliver(self, fut: asyncio.Future, slot: Slot) -> None:
        if fut.done():
            self.release(slot)  # the waiter gave up meanwhile
        else:
            fut.set_result(slot)
