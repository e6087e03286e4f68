"""What a transport is: a bucket in, a payload out (and where the transfer's time went).

A transport turns the planned buckets of one sync into payloads, one at a time: each names
the session verb that carries it and builds the request every engine is sent. The
transaction (`sync.py`) posts each payload through every engine's session before asking for
the next one, so a transport never calls an engine itself, and its own waits between
payloads (a free pack buffer, the answers to an earlier request) see the calls it posted.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_like.engine.deadlines import CallClock
from slime_like.engine.session import EngineSession
from slime_like.protocol.buckets import Bucket
from slime_like.weights.packing import WeightSource
from slime_like.weights.watch import EngineCall, Watch


@dataclass
class TransferStats:
    """Where the transfer's time went (seconds); filled by the transports and the sync."""

    bytes: int = 0
    buckets: int = 0
    pack_s: float = 0.0      # trainer-side packing (GPU: measured by CUDA events)
    wire_s: float | None = None  # broadcast busy time seen by the trainer (GPU events only)
    http_s: float = 0.0      # summed engine request latency (receive + load + HTTP)
    wait_s: float = 0.0      # host time blocked on buffers or engines
    prep_s: float = 0.0      # host time building requests (views, layouts, payloads, submits)
    first_call_s: float | None = None  # from the transfer's start to its first engine call
    started: float = field(default_factory=time.perf_counter, repr=False)
    per_engine_http_s: dict[str, float] = field(default_factory=dict)
    delta: dict | None = None  # delta mode: what was sent and why (weights/delta.py)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_http(self, url: str, sent_at: float, seconds: float) -> None:
        with self._lock:
            if self.first_call_s is None or sent_at - self.started < self.first_call_s:
                self.first_call_s = sent_at - self.started
            self.http_s += seconds
            self.per_engine_http_s[url] = self.per_engine_http_s.get(url, 0.0) + seconds

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "buckets": self.buckets, "pack_s": round(self.pack_s, 6),
                "wire_s": None if self.wire_s is None else round(self.wire_s, 6), "http_s": round(self.http_s, 6),
                "wait_s": round(self.wait_s, 6), "prep_s": round(self.prep_s, 6),
                "first_call_s": None if self.first_call_s is None else round(self.first_call_s, 6),
                "per_engine_http_s": {k: round(v, 6) for k, v in self.per_engine_http_s.items()},
                **({"delta": self.delta} if self.delta is not None else {})}


@dataclass
class Payload:
    """One request's worth of a sync, as every engine is sent it.

    `request(engine, flush, version)` builds the engine's request: `flush` and `version` are
    set on the sync's last payload only (the engine then flushes, and serves the version).
    `after`, when given, replaces the lane's strict order (the previous call answered) with
    the payloads whose answers this one waits for (none: it may go at once); either still
    implies the engine took up the payload before it. The sync fills `calls` once it posted
    the payload.
    """

    step: str
    verb: str
    request: Callable[[EngineSession, bool, str | None], Any]
    nbytes: int
    last: bool
    after: Sequence[Payload] | None = None
    calls: list[EngineCall] = field(default_factory=list)


class Transport(ABC):
    """Turns buckets into payloads; the transaction does the rest."""

    name: str = ""
    #: whether engines need begin/end_weight_update around it (sglang gates only some)
    gated: bool = True
    #: what the engines' calls took lately (the sync's), for the waits of the transport's
    #: own calls (a group's joins)
    clock: CallClock | None = None

    def attach(self, engines: Sequence[EngineSession]) -> None:  # noqa: B027
        """Prepare before the engines are paused (e.g. build a weight group)."""

    def prepare(self, buckets: Sequence[Bucket]) -> None:  # noqa: B027
        """Allocate what the planned buckets need (at attach, not in the first sync)."""

    @abstractmethod
    def payloads(self, engines: Sequence[EngineSession], source: WeightSource,
                 buckets: Sequence[Bucket], version: str, watch: Watch, stats: TransferStats
                 ) -> Iterator[Payload]:
        """Every bucket's payload, in order; done when every byte is on its way (the sync
        then waits for the engines' answers)."""

    def forget(self, urls: Sequence[str]) -> None:  # noqa: B027
        """These engines left (dropped, or back as a new process): nothing this transport
        set up with them is to be reused."""

    def explain(self, err: Any) -> Any:
        """A failed transfer's error, with what this transport knows about such failures."""
        return err

    def failed(self) -> None:  # noqa: B027
        """A transfer failed: stop pending I/O so engines stuck receiving fail fast."""

    def abandon(self, answering: Sequence[str]) -> None:  # noqa: B027
        """After a failed sync, once no call is in flight: the engines that still answer
        leave whatever this transport made them join (the next sync starts afresh)."""

    def close(self, engines: Sequence[EngineSession]) -> None:  # noqa: B027
        """Release groups and buffers."""
