"""A drain, engine side: wait for an unrouted engine's running requests, move the rest.

The fleet takes the engine out of its router first (DRAINING), so nothing new reaches it;
this part only watches what still runs there (`/v1/loads`: running plus waiting) until it
is idle, and at the deadline aborts what is left. An aborted request answers its client
with `finish_reason: abort`, and every client of the fleet (`RouterGenerator`) sends it
again through the router, to another engine (as prompt + partial output with
`partial_rollout`): the request is moved, not lost, and its first answer is the one kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from slime_like.engine.session import EngineSession

logger = logging.getLogger(__name__)

POLL_S = 0.1
# Idle polls in a row before the engine counts as idle: a request the router dispatched
# just before the removal may still be on its way.
IDLE_POLLS = 2
# After the abort, how long the aborted answers may take to leave the engine.
ABORT_SETTLE_S = 5.0
CALL_TIMEOUT_S = 5.0  # one look at the engine's loads


@dataclass(frozen=True)
class Drained:
    """One engine's drain: requests running when it began, those moved at the deadline
    (aborted and resubmitted by their clients), its seconds, and whether the engine still
    answered (an engine that died while draining: its clients resubmit on their own)."""

    engine_id: str
    url: str
    running: int
    moved: int
    seconds: float
    answered: bool = True

    def as_dict(self) -> dict:
        return {"engine": self.engine_id, "url": self.url, "running": self.running,
                "moved": self.moved, "seconds": round(self.seconds, 3),
                "answered": self.answered}


def drain_requests(engine_id: str, handle: EngineSession, deadline_s: float) -> Drained:
    """Wait until `handle`'s engine runs nothing, up to `deadline_s`; then abort the rest."""
    t0 = time.monotonic()
    first = handle.in_flight(CALL_TIMEOUT_S)
    if first is None:
        return Drained(engine_id, handle.url, 0, 0, time.monotonic() - t0, answered=False)
    idle = 0
    while time.monotonic() - t0 < deadline_s:
        n = handle.in_flight(CALL_TIMEOUT_S)
        if n is None:
            return Drained(engine_id, handle.url, first, 0, time.monotonic() - t0, False)
        idle = idle + 1 if n == 0 else 0
        if idle >= IDLE_POLLS:
            return Drained(engine_id, handle.url, first, 0, time.monotonic() - t0)
        time.sleep(POLL_S)
    left = handle.in_flight(CALL_TIMEOUT_S) or 0
    if left:
        logger.info("%s (%s): %d requests still running after the drain's %gs: moving them",
                    engine_id, handle.url, left, deadline_s)
        try:
            handle.abort_request(abort_all=True, timeout=2 * CALL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - gone: its clients resubmit on their own
            logger.warning("%s (%s): abort of the drain failed: %s", engine_id, handle.url, err)
            return Drained(engine_id, handle.url, first, left, time.monotonic() - t0, False)
        settle = time.monotonic() + ABORT_SETTLE_S
        while time.monotonic() < settle and (handle.in_flight(CALL_TIMEOUT_S) or 0) > 0:
            time.sleep(POLL_S)
    return Drained(engine_id, handle.url, max(first, left), left, time.monotonic() - t0)


@dataclass(frozen=True)
class DrainReport:
    """What `fleet.drain` did: each engine's drain, and which engines wait for the next
    regroup (the next full weight update) before they stop; the others have stopped."""

    engines: tuple[Drained, ...]
    waiting_for_regroup: tuple[str, ...] = ()

    @property
    def moved(self) -> int:
        """Requests still running at the deadline, moved to other engines."""
        return sum(d.moved for d in self.engines)

    def as_dict(self) -> dict:
        return {"drained": [d.as_dict() for d in self.engines], "moved": self.moved,
                "waiting_for_regroup": list(self.waiting_for_regroup)}
