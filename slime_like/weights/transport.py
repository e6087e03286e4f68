"""What every transport gets for one transfer (and where its time went), and what it must
provide."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from slime_like.engine.session import EngineSession
from slime_like.errors import EngineError
from slime_like.protocol.buckets import Bucket
from slime_like.weights.packing import WeightSource
from slime_like.weights.watch import Watch


@dataclass
class TransferStats:
    """Where the transfer's time went (seconds); filled by the transports."""

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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_http(self, url: str, seconds: float) -> None:
        with self._lock:
            self.http_s += seconds
            self.per_engine_http_s[url] = self.per_engine_http_s.get(url, 0.0) + seconds

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "buckets": self.buckets, "pack_s": round(self.pack_s, 6),
                "wire_s": None if self.wire_s is None else round(self.wire_s, 6), "http_s": round(self.http_s, 6),
                "wait_s": round(self.wait_s, 6), "prep_s": round(self.prep_s, 6),
                "first_call_s": None if self.first_call_s is None else round(self.first_call_s, 6),
                "per_engine_http_s": {k: round(v, 6) for k, v in self.per_engine_http_s.items()}}


def timed(fn: Callable, stats: TransferStats, url: str) -> Callable:
    """Wrap an engine call so its latency lands in the stats."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        if stats.first_call_s is None:
            stats.first_call_s = start - stats.started
        try:
            return fn(*args, **kwargs)
        finally:
            stats.add_http(url, time.perf_counter() - start)
    return run


# sglang 0.5.23's answer when the weights landed but the flush after them was refused.
FLUSH_REFUSED_MARK = "Weights were updated, but the cache was not flushed"


@dataclass
class TransferContext:
    """One sync's transfer: runs between begin_weight_update and end_weight_update."""

    engines: Sequence[EngineSession]
    buckets: Sequence[Bucket]
    source: WeightSource
    weight_version: str
    watch: Watch
    stats: TransferStats
    http_timeout_s: float
    #: engines whose last update carries flush_cache=true (saves the separate /flush_cache)
    flush_last: frozenset[str] = frozenset()
    #: engine url -> why the flush folded into its last update was refused (weights landed)
    flush_refused: dict[str, str] = field(default_factory=dict)

    #: engine url -> its last control call (pause or begin), sent ahead and not awaited
    control: dict[str, Future] = field(default_factory=dict)
    #: engine url -> the answer to its last update (it says whether the version was set)
    last_answers: dict[str, Any] = field(default_factory=dict)

    def update_call(self, fn: Callable, engine: EngineSession, last: bool) -> Callable:
        """The engine call for one update; a refused folded flush is recorded, not raised."""
        timed_fn = timed(fn, self.stats, engine.url)
        if not last:
            return timed_fn
        folded = engine.url in self.flush_last

        def call(req, timeout):
            try:
                out = timed_fn(req, timeout)
            except EngineError as e:
                if folded and e.status == 400 and FLUSH_REFUSED_MARK in e.body:
                    self.flush_refused[engine.url] = e.body
                    return None
                raise
            self.last_answers[engine.url] = out
            return out
        return call

    def version_set(self, engine: EngineSession) -> bool:
        """Whether the engine's answer to its last update says it now serves weight_version."""
        answer = self.last_answers.get(engine.url)
        message = answer.get("message", "") if isinstance(answer, dict) else ""
        return f"Weight version updated to {self.weight_version}" in str(message)

    def gate(self, engine: EngineSession, gate: Callable[[], bool] | None) -> Callable[[], bool] | None:
        """`gate`, also waiting for the engine's pause/begin (a strict lane gate already does)."""
        before = self.control.get(engine.url)
        if gate is None or before is None:
            return gate
        return lambda: before.done() and gate()

    def flush_flag(self, engine: EngineSession, last: bool) -> bool:
        return last and engine.url in self.flush_last


class Transport(ABC):
    """Moves the bytes of one sync into every engine; the transaction does the rest."""

    name: str = ""
    #: whether engines need begin/end_weight_update around it (sglang gates only some)
    gated: bool = True

    def attach(self, engines: Sequence[EngineSession]) -> None:  # noqa: B027
        """Prepare before the engines are paused (e.g. build a weight group)."""

    def prepare(self, buckets: Sequence[Bucket]) -> None:  # noqa: B027
        """Allocate what the planned buckets need (at attach, not in the first sync)."""

    @abstractmethod
    def transfer(self, ctx: TransferContext) -> None:
        """Send every bucket; the last update to each engine carries `weight_version`."""

    def failed(self) -> None:  # noqa: B027
        """A transfer failed: stop pending I/O so engines stuck receiving fail fast."""

    def abandon(self) -> None:  # noqa: B027
        """After a failed sync, once no call is in flight: the engines leave whatever this
        transport made them join (the next sync starts afresh)."""

    def close(self, engines: Sequence[EngineSession]) -> None:  # noqa: B027
        """Release groups and buffers."""
