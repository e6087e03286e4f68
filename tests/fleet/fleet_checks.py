"""What the fleet tests check after a fault: who is routed, and everyone back in service."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

from slime_like.api import EngineState, Happening


def routed_urls(fleet, model: str = "policy") -> set[str]:
    """The engines the real router lists now."""
    return {w.url for w in fleet.routers[model].client.list_workers()}


def wait_all_registered(fleet, timeout: float = 60) -> None:
    """Recoveries and resyncs finished, and every engine REGISTERED (asserted)."""
    assert fleet.wait_recovered(timeout=120)
    deadline = time.monotonic() + timeout
    while set(fleet.states().values()) != {"REGISTERED"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(fleet.states().values()) == {"REGISTERED"}


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process SIGSTOPped for the body; continued after it, whatever happened (a no-op
    when its recovery killed it meanwhile)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def recorder(fleet) -> list:
    events: list = []
    fleet.subscribe(events.append)
    return events


def first(events: list, start: int = 0, **match) -> int | None:
    """Index of the first event from `start` whose attributes match (None if none)."""
    for i in range(start, len(events)):
        ev = events[i]
        if all(getattr(ev, k) == v if k != "kind" else ev.kind is v for k, v in match.items()):
            return i
    return None


def check_landed_while_suspect(fleet, events: list, hung, others: list, report: dict,
                               expected: str) -> int:
    """The sync landed on the other engines at the next version, after the hung one was
    out of it and the router as SUSPECT for its pause past the deadline (not DEAD: the
    monitor's verdict never came first); the index of the fleet's VERSION event."""
    assert sorted(report["engines"]) == sorted(o.url for o in others)
    assert fleet.version.wire == expected
    assert {o.handle.weight_version() for o in others} == {expected}
    suspect = first(events, subject=hung.engine_id, kind=EngineState.SUSPECT)
    landed = first(events, subject="fleet", kind=Happening.VERSION)
    assert suspect is not None and landed is not None and suspect < landed, events
    reason = str(events[suspect].details.get("reason"))
    assert "hung during a weight sync" in reason and "pause_generation" in reason, reason
    assert "deadline" in reason and hung.url in reason, reason
    dead = first(events, subject=hung.engine_id, kind=EngineState.DEAD)
    assert dead is None or dead > landed, events
    return landed
