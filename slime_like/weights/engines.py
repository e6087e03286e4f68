"""The engines a sync talks to: address, TP size, what their sglang version supports.

Version-dependent behaviour is read once from `/server_info` `version` (the reference
engine reports the sglang version whose protocol it speaks):
- `begin_weight_update` / `end_weight_update` exist since 0.5.21 (and then are required
  around distributed and tensor updates);
- `flattened_bucket` over `update_weights_from_distributed` exists since 0.5.9;
- a flush after a `retract` pause only works where retracted requests give their KV back,
  which 0.5.23 does; older engines keep it and the flush is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from slime_like.engine.client import EngineClient
from slime_like.errors import EngineError, WeightSyncError

T = TypeVar("T")

BEGIN_END_SINCE = (0, 5, 21)
FLATTENED_DISTRIBUTED_SINCE = (0, 5, 9)
FLUSH_AFTER_RETRACT_SINCE = (0, 5, 23)


def parse_version(text: Any) -> tuple[int, ...] | None:
    """'0.5.23' / '0.5.23.post1' / 'v0.5.9rc0' -> (0, 5, 23); None when unknown."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return tuple(int(x or 0) for x in m.groups()) if m else None


@dataclass
class EngineTarget:
    """One engine of a sync: its URL (the name every error uses) and TP size."""

    url: str
    tp_size: int = 1
    client: EngineClient | None = None
    version: tuple[int, ...] | None = None
    server_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if self.tp_size < 1:
            raise ValueError(f"engine {self.url}: tp_size must be >= 1, got {self.tp_size}")
        if self.client is None:
            self.client = EngineClient(self.url)

    def probe(self) -> None:
        """Read /server_info once: version and the TP size the engine really runs."""
        self.server_info = self.client.server_info() or {}
        self.version = parse_version(self.server_info.get("version"))
        tp = self.server_info.get("tp_size")
        if tp is not None and int(tp) != self.tp_size:
            raise WeightSyncError("attach", f"the engine runs tp_size={tp} but the sync was "
                                  f"configured with tp_size={self.tp_size}", self.url)
        if int(self.server_info.get("dp_size") or 1) > 1:
            raise WeightSyncError("attach", "weight updates need dp_size == 1 per engine "
                                  "(sglang asserts it); run one server per DP replica", self.url)
        if int(self.server_info.get("pp_size") or 1) > 1:
            raise WeightSyncError("attach", "weight groups place ranks at rank_offset + "
                                  "tp_rank only, so pp_size must be 1", self.url)

    def _at_least(self, since: tuple[int, ...], unknown: bool) -> bool:
        return unknown if self.version is None else self.version >= since

    @property
    def has_begin_end(self) -> bool:
        return self._at_least(BEGIN_END_SINCE, unknown=True)

    @property
    def has_flattened_distributed(self) -> bool:
        return self._at_least(FLATTENED_DISTRIBUTED_SINCE, unknown=True)

    @property
    def flushes_after_retract(self) -> bool:
        return self._at_least(FLUSH_AFTER_RETRACT_SINCE, unknown=False)

    def __str__(self) -> str:
        return self.url


def engine_ranks(engines: Sequence[EngineTarget]) -> tuple[list[int], int]:
    """sglang's layout: trainer rank 0, engine i at 1 + sum of earlier tp sizes."""
    offsets, offset = [], 1
    for e in engines:
        offsets.append(offset)
        offset += e.tp_size
    return offsets, offset


class EngineCalls:
    """One single-thread executor per engine: calls to an engine run in submission order.

    Order matters: the bodies of consecutive bucket updates describe consecutive
    broadcasts, so update k+1 must never overtake update k on its way to an engine.
    """

    def __init__(self, engines: Sequence[EngineTarget]):
        self._pools = {e.url: ThreadPoolExecutor(1, thread_name_prefix=f"engine-{i}")
                       for i, e in enumerate(engines)}

    def submit(self, engine: EngineTarget, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._pools[engine.url].submit(fn, *args)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


def on_all(engines: Sequence[EngineTarget], step: str, fn: Callable[[EngineTarget], T],
           timeout: float | None = None) -> list[T]:
    """Run fn on every engine concurrently; the first failure raises naming engine and step.

    Every call is waited for (up to `timeout`) before raising, so no engine is left with a
    half-issued control call when the caller moves on to clean up.
    """
    with ThreadPoolExecutor(max(1, len(engines)), thread_name_prefix=step) as pool:
        futures = [(e, pool.submit(fn, e)) for e in engines]
        results, errors = [], []
        for e, f in futures:
            try:
                results.append(f.result(timeout=timeout))
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                errors.append((e, exc))
    if errors:
        raise step_error(step, errors)
    return results


def step_error(step: str, errors: Sequence[tuple[EngineTarget, BaseException]]) -> WeightSyncError:
    """One WeightSyncError for failures on one or more engines (the first names the engine).

    A WeightSyncError raised by the call itself (e.g. WeightMetadataError) is kept, type
    and all, with the other engines' failures appended to its message.
    """
    first_engine, first = errors[0]
    others = "; also failed on " + ", ".join(
        f"{e.url} ({describe(x)})" for e, x in errors[1:]) if len(errors) > 1 else ""
    if isinstance(first, WeightSyncError):
        if others:
            first.args = (str(first) + others,)
        return first
    err = WeightSyncError(step, describe(first) + others, first_engine.url)
    err.__cause__ = first
    return err


def describe(exc: BaseException) -> str:
    if isinstance(exc, WeightSyncError):
        return exc.detail
    if isinstance(exc, EngineError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
