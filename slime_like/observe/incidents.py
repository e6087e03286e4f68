"""Engine deaths and their recoveries, read from the stream of fleet events.

The fleet reports every state change as a timeline row (`engine`, `state`, `time_s`,
details). Most are routine (`fleet.events.ROUTINE`: each weight update moves every engine
REGISTERED -> UPDATING -> REGISTERED); an operator wants the few that are not: a death, the
relaunch, and how long until the replacement served again. The report, wandb and the
Prometheus metrics all read them from here, so they cannot disagree about what a recovery
is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slime_like.fleet.events import EngineState, Kind, RouterState, is_router, kind_of

DEATHS = frozenset({EngineState.DEAD, RouterState.DEAD})


def _kind(event: dict[str, Any]) -> Kind:
    return kind_of(event["state"], str(event["engine"]))


def _serves(event: dict[str, Any]) -> bool:
    """An engine routed again, or a router relaunched (it serves once READY)."""
    if is_router(str(event["engine"])):
        return _kind(event) is RouterState.READY
    return _kind(event) is EngineState.REGISTERED


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
        engine, t = event["engine"], float(event.get("time_s", 0.0))
        open_ = self._open.get(engine)
        if _kind(event) in DEATHS:
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
