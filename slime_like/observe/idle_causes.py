"""Why an engine runs no request: each idle poll of `EngineUtilization` blamed on one cause.

An engine with no request running is either waiting for work nobody had (the producer at
its staleness window waits for the trainer: no dispatch can fill that), or for work that
existed but was elsewhere (on its way between the client and the engine, queued on another
engine, just retracted by a sync). The poller reads each engine's `/v1/loads` and, right
after its answer, what the rollout client holds for that engine (`ClientView`); `blame`
names the first cause that holds, in this order:

- `engine_queue`: the engine has requests waiting and none running (they arrived, or a
  sync's resume gave back retracted ones, and its next step admits them);
- `round_trip`: the client has requests bound to the engine that it does not run: an
  answer on its way back or the next request on its way in (admission dispatch); through
  a router, the client has more requests out than all engines hold (running or queued):
  the rest are on their way through the router;
- `routed_elsewhere`: another engine has requests queued that this one could run;
- `hand_out`: requests wait in the client for a slot while this engine has one free;
- `producer_window`: the producer admits no new group until the trainer trains (the
  staleness window is full): the schedule's, not dispatch's;
- `sync_edge`: the engine was paused at the poll before (a sync just resumed it);
- `no_request`: none of the above: the client had nothing for it.

`DISPATCH` and `SYNC_EDGE` group them as the benchmark reports them: what a dispatch
policy can still win, what a sync's edges cost, and what the schedule leaves idle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ENGINE_QUEUE = "engine_queue"
ROUND_TRIP = "round_trip"
ROUTED_ELSEWHERE = "routed_elsewhere"
HAND_OUT = "hand_out"
PRODUCER_WINDOW = "producer_window"
SYNC_EDGE = "sync_edge"
NO_REQUEST = "no_request"
CAUSES = (ENGINE_QUEUE, ROUND_TRIP, ROUTED_ELSEWHERE, HAND_OUT, PRODUCER_WINDOW, SYNC_EDGE,
          NO_REQUEST)
DISPATCH = (ROUND_TRIP, ROUTED_ELSEWHERE, HAND_OUT)   # what binding requests better wins
SYNC_EDGES = (ENGINE_QUEUE, SYNC_EDGE)                 # a sync's resume, an engine's step
SCHEDULE = (PRODUCER_WINDOW, NO_REQUEST)               # the client had nothing to send


@dataclass(frozen=True)
class ClientView:
    """What the rollout client holds for one engine at one moment."""

    bound: int | None = None      # requests bound to the engine (admission), None: router
    waiting: int = 0              # requests waiting in the client for a slot (admission)
    producer_full: bool = False   # the producer's staleness window admits no group now
    out: int = 0                  # requests sent and not answered (through a router too)


def blame(engine: str, queued: Mapping[str, int], client: ClientView | None,
          was_paused: bool, held: int = 0) -> str:
    """The cause of one idle poll of `engine` (running none, not paused); `queued`: every
    engine's waiting requests at the same poll, `held`: the requests all engines hold."""
    if queued.get(engine, 0) > 0:
        return ENGINE_QUEUE
    if client is not None and (client.bound if client.bound is not None
                               else client.out > held):
        return ROUND_TRIP
    if any(n > 0 for e, n in queued.items() if e != engine):
        return ROUTED_ELSEWHERE
    if client is not None and client.waiting > 0:
        return HAND_OUT
    if client is not None and client.producer_full:
        return PRODUCER_WINDOW
    if was_paused:
        return SYNC_EDGE
    return NO_REQUEST
