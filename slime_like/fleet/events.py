"""What the fleet tells the rest of the run: one event type, and which events are routine.

Every change the fleet makes is a `FleetEvent`: its subject (an engine id, `router/<model>`,
`node/<ip>` or `fleet`), its kind (an enum member, never a bare string) and details. Two sorts are
told apart:

- a *state change* of an engine (`EngineState`) or a router (`RouterState`): it carries the
  state it left (`previous`; None for the first one);
- a *happening* (`Happening`): something that is not a state, so it has no previous one
  (the fleet's version moved on, an engine was taken out of its router while paused, a
  recovery ended).

`ROUTINE` is the one definition of what a healthy run does over and over (start, every
weight update and the fleet's new version, a colocated engine's release and resume around each train step); the
report lists the other events, and the incidents, tracking and Prometheus read the same
enums.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class _Name(str, enum.Enum):
    """An enum whose members print as their names (as they are spelled on the timeline)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class EngineState(_Name):
    """Where an engine is in its lifecycle (the table is in `fleet/lifecycle.py`)."""

    LAUNCHING = "LAUNCHING"
    LOADED = "LOADED"
    UPDATING = "UPDATING"
    REGISTERED = "REGISTERED"
    SUSPECT = "SUSPECT"
    STALE = "STALE"
    DEAD = "DEAD"
    RELAUNCHING = "RELAUNCHING"
    REATTACHING = "REATTACHING"
    OFFLOADED = "OFFLOADED"
    DRAINING = "DRAINING"      # leaving the fleet: out of the router, its requests end
    STOPPED = "STOPPED"


class RouterState(_Name):
    """A model's router: serving, exited, or not relaunched (the run cannot go on)."""

    READY = "READY"
    DEAD = "DEAD"
    FAILED = "FAILED"


class Happening(_Name):
    """Events that are not states: they have no previous state."""

    VERSION = "VERSION"        # the fleet serves a new weight version
    UNROUTED = "UNROUTED"      # a paused engine stopped answering: out of its router
    RECOVERED = "RECOVERED"    # an engine's recovery ended (it serves again)
    DRAINED = "DRAINED"        # a draining engine's requests finished or were moved
    NODE_LOST = "NODE_LOST"    # Ray declared a node dead: every engine on it died (node/<ip>)
    WAITING_FOR_CAPACITY = "WAITING_FOR_CAPACITY"  # a lost node's engine has no room yet


State = EngineState | RouterState
Kind = EngineState | RouterState | Happening
KINDS: tuple[type[enum.Enum], ...] = (EngineState, RouterState, Happening)


def is_router(subject: str) -> bool:
    """Whether a subject names a router (`router/<model>`) rather than an engine."""
    return subject.split("/", 1)[0] == "router"


def is_engine(subject: str) -> bool:
    """Whether a subject names an engine (not a router, a node or the fleet itself)."""
    return subject != "fleet" and subject.split("/", 1)[0] not in ("router", "node")


def kind_of(text: str | Kind, subject: str = "") -> Kind:
    """The enum member a timeline row names (its `state` column); routers have their own."""
    if isinstance(text, KINDS):
        return text
    if is_router(subject):
        return RouterState(text)
    for enum_type in (EngineState, Happening):
        try:
            return enum_type(text)
        except ValueError:
            continue
    raise ValueError(f"{text!r} is no fleet state or happening")


@dataclass(frozen=True)
class FleetEvent:
    """One thing the fleet did: subject, kind (enum), the state left, details, wall time."""

    subject: str
    kind: Kind
    previous: State | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, KINDS):
            raise TypeError(f"event kind {self.kind!r} of {self.subject} is not a fleet enum")
        if self.previous is not None and isinstance(self.kind, Happening):
            raise TypeError(f"{self.kind.value} is a happening, not a state: it has no previous")

    @property
    def is_state_change(self) -> bool:
        return isinstance(self.kind, EngineState | RouterState)

    def row(self) -> dict[str, Any]:
        """The details as a timeline row writes them (`previous` first, then the rest)."""
        out: dict[str, Any] = {}
        if self.previous is not None:
            out["previous"] = self.previous.value
        out.update(self.details)
        return out


S = EngineState
# The moves of a healthy run, each weight update and each colocated train step: the report
# leaves them out. A REGISTERED that ends a recovery is still shown (the report adds it).
ROUTINE: frozenset[tuple[State | None, Kind]] = frozenset({
    (None, S.LAUNCHING), (S.LAUNCHING, S.LOADED),
    (S.LOADED, S.UPDATING), (S.REGISTERED, S.UPDATING), (S.STALE, S.UPDATING),
    (S.UPDATING, S.REGISTERED), (S.SUSPECT, S.REGISTERED),
    # colocated: memory released for the train step, and resumed (with or without weights)
    (S.REGISTERED, S.OFFLOADED), (S.OFFLOADED, S.REGISTERED), (S.OFFLOADED, S.STALE),
    # the fleet's version moving on: once per sync (the metrics carry it per step)
    (None, Happening.VERSION),
})


def is_routine(previous: State | None, kind: Kind) -> bool:
    """Whether a (previous state, kind) pair is one a healthy run repeats."""
    return (previous, kind) in ROUTINE


def previous_of(row: Mapping[str, Any]) -> State | None:
    """The state a timeline row's subject left (None for a first state or a happening)."""
    text = row.get("previous")
    if text is None:
        return None
    return RouterState(text) if is_router(str(row.get("engine", ""))) else EngineState(text)


EventSink = Callable[[FleetEvent], None]


class EventBus:
    """The fleet's subscribers; a broken one is logged and never breaks the lifecycle."""

    def __init__(self, sink: EventSink | None = None):
        self._sinks: list[EventSink] = [sink] if sink else []
        self._lock = threading.Lock()

    def subscribe(self, sink: EventSink) -> None:
        with self._lock:
            self._sinks.append(sink)

    def emit(self, subject: str, kind: Kind, previous: State | None = None,
             **details: Any) -> FleetEvent:
        event = FleetEvent(subject, kind, previous, details)
        with self._lock:
            sinks = list(self._sinks)
        for sink in sinks:
            try:
                sink(event)
            except Exception:  # noqa: BLE001 - a broken sink must not break the lifecycle
                logger.exception("event sink failed")
        return event
