"""The control calls of one weight-sync transaction, engine by engine.

Pause and begin go out in each engine's ordered lane (sent, not awaited: each engine's lane
sends pause, then begin, then bucket 1, each once the one before was answered), end and
continue right behind the last update where nothing else is due; the flush follows the
pause mode's rule; verify reads `/model_info`; continue resumes every paused engine, also
after a failure. Each call's round trip is timed for the report.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from slime_like.engine.handle import EngineHandle
from slime_like.errors import EngineError, WeightSyncError
from slime_like.protocol.compat import FLUSH_AFTER_RETRACT_SINCE
from slime_like.weights.fanout import CallCancelled, EngineCalls, on_all
from slime_like.weights.sync_config import SyncReport, WeightSyncConfig
from slime_like.weights.transport import TransferContext, TransferStats
from slime_like.weights.watch import EngineCall

log = logging.getLogger(__name__)


class Control:
    """The transaction's calls to the engines, for one WeightSync's settings."""

    def __init__(self, config: WeightSyncConfig,
                 warn_once: Callable[[str, str, SyncReport | None], None]):
        self.config = config
        self.warn_once = warn_once

    def pause_and_begin(self, engines: list[EngineHandle], paused: list[EngineHandle],
                        begun: list[EngineHandle], report: SyncReport, calls: EngineCalls,
                        sent: list[EngineCall], *, gated: bool,
                        quiet: frozenset[str] = frozenset()) -> list[EngineCall]:
        """Queue pause (and begin, where gated) in every engine's lane; the last call of each
        is returned, every call is added to `sent`. `quiet` engines (nothing can reach
        them, nothing runs) are not paused; `report.not_paused` lists them."""
        mode = self.config.pause_mode
        lock = threading.Lock()
        out: list[EngineCall] = []

        def pause(engine: EngineHandle) -> Any:
            if mode == "abort":  # how many requests the pause is about to abort
                with contextlib.suppress(EngineError, KeyError, TypeError):
                    loads = engine.loads().get("loads") or []
                    report.in_flight_at_pause[engine.url] = sum(
                        int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0))
                        for x in loads)
            return engine.pause_generation(mode, timeout=self.config.http_timeout_s)

        def begin(engine: EngineHandle) -> Any:
            try:
                answer = engine.begin_weight_update()
            except EngineError as e:
                if e.status == 404:  # an engine without sessions (sglang < 0.5.21)
                    engine.version = engine.version or (0, 5, 20)
                    return None
                if e.status == 400 and "already open" in e.body:
                    # left open by an earlier failed sync whose end did not get through
                    engine.end_weight_update()
                    answer = engine.begin_weight_update()
                else:
                    raise
            with lock:
                begun.append(engine)
            return answer

        for engine in engines:
            call = None
            if engine.url in quiet:
                report.not_paused.append(engine.url)
            else:
                paused.append(engine)  # even a pause that times out may have paused it
                call = _call(calls, engine, "pause_generation", pause)
                sent.append(call)
            if gated and engine.has_begin_end:
                call = _call(calls, engine, "begin_weight_update", begin)
                sent.append(call)
            if call is not None:
                out.append(call)
        return out

    def can_pipeline_end(self, engines: list[EngineHandle], folded: frozenset[str],
                          ctx: TransferContext, report: SyncReport) -> bool:
        """True when nothing but end and continue is left: versions seen, no separate flush."""
        return all(ctx.version_set(e) and (e.url in folded or self.flush_plan(e, report) is not None)
                   for e in engines)

    @staticmethod
    def submit_end(begun: list[EngineHandle], calls: EngineCalls) -> list[EngineCall]:
        return [_call(calls, e, "end_weight_update", lambda e: e.end_weight_update())
                for e in begun]

    def submit_continue(self, paused: list[EngineHandle], ends: list[EngineCall],
                         calls: EngineCalls) -> list[EngineCall]:
        """continue_generation right behind every end; not sent if an end failed and the
        caller keeps failed syncs paused (resume_on_failure=False)."""
        keep_paused = not self.config.resume_on_failure
        futures = [c.future for c in ends]

        def resume(engine: EngineHandle) -> Any:
            if keep_paused and any(f.exception() is not None for f in futures):
                raise CallCancelled("not sent: end_weight_update failed on an engine")
            return engine.continue_generation()

        def gate() -> bool:
            return all(f.done() for f in futures)

        return [_call(calls, e, "continue_generation", resume, gate) for e in paused]

    def flush_plan(self, engine: EngineHandle, report: SyncReport) -> str | None:
        """None when the engine's cache is to be flushed, else why not (the pause-mode rule)."""
        mode = self.config.pause_mode
        if not self.config.flush_cache:
            return "skipped: flush_cache is off"
        if mode == "in_place":
            return "skipped: in_place keeps the KV cache by design"
        if mode == "retract" and not engine.flushes_after_retract:
            self.warn_once(f"flush:{engine.url}", (
                f"engine {engine.url} (sglang {engine.server_info.get('version')}) keeps "
                "retracted requests' KV, so its prefix cache is not flushed after a "
                "retract-mode sync; stale prefixes may be reused until it is flushed"), report)
            return "skipped: engine keeps retracted KV"
        return None

    @staticmethod
    def folds_flush(engine: EngineHandle) -> bool:
        # 0.5.23 answers a refused post-update flush with 400 (weights kept); older engines
        # crash on it, so they get a separate /flush_cache, which is refused harmlessly.
        return engine.version is not None and engine.version >= FLUSH_AFTER_RETRACT_SINCE

    def flush(self, engines: list[EngineHandle], folded: frozenset[str],
               refused: dict[str, str], report: SyncReport) -> None:
        def flush(engine: EngineHandle) -> None:
            skip = self.flush_plan(engine, report)
            if skip is not None:
                report.flush[engine.url] = skip
                return
            if engine.url in folded:
                ok, why = engine.url not in refused, refused.get(engine.url, "")
            else:
                try:
                    ok, why = engine.try_flush_cache(), "the engine was not idle"
                except EngineError as e:
                    ok, why = False, str(e)
            if ok:
                report.flush[engine.url] = "flushed"
            else:
                report.flush[engine.url] = f"refused: {why}"
                report.warnings.append(f"engine {engine.url} refused the cache flush after the "
                                       "new weights landed; its prefix cache may be stale")

        on_all(engines, "flush_cache", flush)

    @staticmethod
    def verify(engine: EngineHandle, version: str) -> None:
        got = engine.weight_version()
        if got != version:
            raise WeightSyncError("verify_weight_version",
                                  f"engine reports weight_version {got!r}, expected {version!r}",
                                  engine.url)

    def resume(self, paused: list[EngineHandle], sent: Sequence[EngineCall] = ()
                  ) -> list[tuple[str, str]]:
        """Every paused engine resumed: [(url, problem)] for those it failed on.

        A continue already sent through the engine's lane counts once answered; one that
        was never sent (cancelled after a failure) or failed is sent again here.
        """
        problems: list[tuple[str, str]] = []
        lock = threading.Lock()
        done = set()
        for call in sent:
            with contextlib.suppress(Exception):
                call.future.result(timeout=self.config.http_timeout_s)
                done.add(call.engine.url)
        todo = [e for e in paused if e.url not in done]

        def resume(engine: EngineHandle) -> None:
            try:
                engine.continue_generation()
            except Exception as e:  # noqa: BLE001 - collected and reported by the caller
                with lock:
                    problems.append((engine.url, str(e)))

        if todo:
            on_all(todo, "continue_generation", resume)
        return problems

    def end_quietly(self, engines: list[EngineHandle]) -> None:
        def end(engine: EngineHandle) -> None:
            with contextlib.suppress(Exception):
                engine.end_weight_update(timeout=min(30.0, self.config.http_timeout_s))
        if engines:
            with contextlib.suppress(WeightSyncError):
                on_all(engines, "end_weight_update", end)


class _Timed:
    """An engine call that remembers how long its HTTP round trip took once sent."""

    def __init__(self, fn: Callable[[EngineHandle], Any]):
        self.fn = fn
        self.seconds: float | None = None

    def __call__(self, engine: EngineHandle) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(engine)
        finally:
            self.seconds = time.perf_counter() - t0


def _call(calls: EngineCalls, engine: EngineHandle, step: str, fn: Callable[[EngineHandle], Any],
          gate: Callable[[], bool] | None = None) -> EngineCall:
    """Queue fn(engine) in the engine's ordered lane (after everything queued before it)."""
    timer = _Timed(fn)
    call = EngineCall(engine, step, calls.submit(engine, timer, engine, gate=gate))
    call.timer = timer
    return call


def settle(sent: Sequence[EngineCall], timeout_s: float) -> None:
    """Wait (bounded) until no queued or running control call is left."""
    deadline = time.monotonic() + timeout_s
    for call in sent:
        with contextlib.suppress(Exception):
            call.future.exception(timeout=max(0.0, deadline - time.monotonic()))


def round_trips(sent: Sequence[EngineCall], stats: TransferStats) -> dict[str, float]:
    """Seconds per control round trip (slowest engine) and per bucket update (mean)."""
    out: dict[str, float] = {}
    for call in sent:
        seconds = getattr(call.timer, "seconds", None)
        if seconds is not None:
            step = call.step.removesuffix("_generation").removesuffix("_weight_update")
            out[step] = max(out.get(step, 0.0), seconds)
    updates = stats.buckets * max(1, len(stats.per_engine_http_s))
    if updates:
        out["update_mean"] = stats.http_s / updates
    return {k: round(v, 6) for k, v in out.items()}
