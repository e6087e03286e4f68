"""Engine deaths and their recoveries, read from the stream of engine state changes.

The rollout side reports every state change (`engine`, `state`, `time_s`, details). Most are
routine (each weight update moves every engine REGISTERED -> UPDATING -> REGISTERED); an
operator wants the few that are not: a death, the relaunch, and how long until the
replacement served again. The report and the Prometheus metrics both read them from here,
so they cannot disagree about what a recovery is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# States every healthy run passes through at each start and weight update.
ROUTINE_STATES = frozenset({"LAUNCHING", "LOADED", "REGISTERED", "UPDATING"})
SERVING = "REGISTERED"
ROUTER_SERVING = "READY"  # a router (engine "router/<model>") serves again once relaunched
DEAD = "DEAD"


def _serves(event: dict[str, Any]) -> bool:
    if str(event["engine"]).startswith("router/"):
        return event["state"] == ROUTER_SERVING
    return event["state"] == SERVING


@dataclass
class Incident:
    """One death of an engine and, once it serves again, when."""

    engine: str
    died_at: float
    reason: str = ""
    recovered_at: float | None = None
    version: str | None = None
    failure: str | None = None  # why the recovery gave up, if it did

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the death to serving again (routed at the current version)."""
        return None if self.recovered_at is None else self.recovered_at - self.died_at


class IncidentLog:
    """Feeds on engine events one by one; knows open and closed incidents per engine."""

    def __init__(self) -> None:
        self.incidents: list[Incident] = []
        self._open: dict[str, Incident] = {}

    def feed(self, event: dict[str, Any]) -> tuple[str, Incident] | None:
        """Take one event; ("died" | "recovered" | "failed", incident) when it is one of those."""
        engine, state, t = event["engine"], event["state"], float(event.get("time_s", 0.0))
        open_ = self._open.get(engine)
        if state == DEAD:
            reason = str(event.get("reason", ""))
            if open_ is not None:  # dead again before serving: the recovery itself failed
                open_.failure = reason or "died again during recovery"
                return "failed", open_
            incident = Incident(engine, t, reason)
            self.incidents.append(incident)
            self._open[engine] = incident
            return "died", incident
        if _serves(event) and open_ is not None:
            open_.recovered_at = t
            open_.version = None if event.get("version") is None else str(event["version"])
            open_.failure = None
            del self._open[engine]
            return "recovered", open_
        return None

    def is_recovery(self, event: dict[str, Any]) -> bool:
        """Whether this SERVING event would close an open incident (call before `feed`)."""
        return _serves(event) and event["engine"] in self._open


def incidents_of(events: Iterable[dict[str, Any]]) -> list[Incident]:
    """Every death in an event stream, with its recovery where there was one."""
    log = IncidentLog()
    for e in events:
        log.feed(e)
    return log.incidents
