"""The control calls of one weight-sync transaction, engine by engine.

Every call goes through the engine's `EngineSession`, which remembers what it changed
(paused, update open) for the undo. Pause and begin go out in each session's ordered lane (sent, not awaited: each engine's lane
sends pause, then begin, then bucket 1, each once the one before was answered), end and
continue right behind the last update where nothing else is due; the flush follows the
pause mode's rule; verify reads `/model_info`; continue resumes every paused engine, also
after a failure. Each call's round trip is timed for the report.

Engines reached through an smg RL control plane (`EngineSession.rl_plane`,
`--router-enable-rl`) get their pause and continue in one smg request per step for all of
them (`engine/rl_plane.py`): each lane's call then takes its engine's answer from that
request, or calls the engine itself where smg did not reach it. Abort-mode pauses stay
per engine (each reads its in-flight count first).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from slime_like.engine.call_pool import all_done
from slime_like.engine.fanout import on_all
from slime_like.engine.rl_plane import PlaneCall, plane_calls, start_all
from slime_like.engine.session import CallCancelled, EngineSession
from slime_like.engine.steps import Blocking, Steps, drive
from slime_like.errors import EngineError, WeightSyncError
from slime_like.protocol.modes import PauseMode
from slime_like.weights.sync_config import StepClock, SyncReport, WeightSyncConfig
from slime_like.weights.transport import TransferStats
from slime_like.weights.watch import EngineCall, Watch

log = logging.getLogger(__name__)


class Control:
    """The transaction's calls to the engines, for one WeightSync's settings."""

    def __init__(self, config: WeightSyncConfig,
                 warn_once: Callable[[str, str, SyncReport | None], None]):
        self.config = config
        self.warn_once = warn_once

    def pause_and_begin(self, engines: list[EngineSession], report: SyncReport,
                        sent: list[EngineCall], *, gated: bool,
                        quiet: frozenset[str] = frozenset()) -> list[EngineCall]:
        """Queue pause (and begin, where gated) in every engine's lane; the last call of each
        is returned, every call is added to `sent`. `quiet` engines (nothing can reach
        them, nothing runs) are not paused; `report.not_paused` lists them."""
        mode = self.config.pause_mode
        out: list[EngineCall] = []
        planes = {} if mode is PauseMode.ABORT else plane_calls(
            [e for e in engines if e.url not in quiet], "pause_generation", {"mode": mode},
            on_sent=EngineSession.record_paused(mode), timeout=self.config.http_timeout_s)
        _reported(planes, report)
        start_all(planes)

        def pause(engine: EngineSession) -> Steps[Any]:
            if mode is PauseMode.ABORT:  # how many requests the pause is about to abort
                count = yield Blocking(engine.in_flight)
                if count is not None:
                    report.in_flight_at_pause[engine.url] = count
            return (yield from engine.pause_steps(mode, timeout=self.config.http_timeout_s,
                                                  via=planes.get(engine.url)))

        for engine in engines:
            engine.new_chain()  # a call that failed in the last update does not stop these
            call = None
            if engine.url in quiet:
                report.not_paused.append(engine.url)
            else:
                call = _call(engine, "pause_generation", pause)
                sent.append(call)
            if gated and engine.has_begin_end:
                call = _call(engine, "begin_weight_update", EngineSession.begin_steps)
                sent.append(call)
            if call is not None:
                out.append(call)
        return out

    def can_pipeline_end(self, engines: list[EngineSession], folded: frozenset[str],
                         answers: LastAnswers, report: SyncReport) -> bool:
        """True when nothing but end and continue is left: versions seen, no separate flush."""
        return all(answers.version_set(e) and
                   (e.url in folded or self.flush_plan(e, report) is not None) for e in engines)

    @staticmethod
    def submit_end(engines: list[EngineSession]) -> list[EngineCall]:
        return [_call(e, "end_weight_update", EngineSession.end_steps)
                for e in engines if e.in_update]

    def submit_continue(self, engines: list[EngineSession], ends: list[EngineCall],
                        report: SyncReport | None = None) -> list[EngineCall]:
        """continue_generation right behind every end; not sent if an end failed and the
        caller keeps failed syncs paused (resume_on_failure=False)."""
        keep_paused = not self.config.resume_on_failure
        futures = [c.future for c in ends]
        # One gate for every continue, and the ends' outcome read once: each continue
        # waiting on (and reading) every end would cost N^2 at N engines.
        gate = [all_done(futures)]
        end_failed = functools.cache(lambda: any(f.exception() is not None for f in futures))
        paused = [e for e in engines if e.paused is not None]
        # Through smg: sent once every end (and every lane's last call) answered; a failure
        # there sends nothing through smg, and each lane does what it did before.
        planes = plane_calls(paused, "continue_generation", {},
                             on_answer=EngineSession.record_continued,
                             timeout=self.config.http_timeout_s)
        _reported(planes, report)
        start_all(planes, [*futures, *filter(None, (e.tail() for e in paused))])

        def resume(engine: EngineSession) -> Steps[Any]:
            if keep_paused and end_failed():
                raise CallCancelled("not sent: end_weight_update failed on an engine")
            return (yield from engine.continue_steps(via=planes.get(engine.url)))

        return [_call(e, "continue_generation", resume, gate) for e in paused]

    def flush_plan(self, engine: EngineSession, report: SyncReport) -> str | None:
        """None when the engine's cache is to be flushed, else why not (the pause-mode rule)."""
        mode = self.config.pause_mode
        if not self.config.flush_cache:
            return "skipped: flush_cache is off"
        if mode is PauseMode.IN_PLACE:
            return "skipped: in_place keeps the KV cache by design"
        if mode is PauseMode.RETRACT and not engine.flushes_after_retract:
            self.warn_once(f"flush:{engine.url}", (
                f"engine {engine.url} (sglang {engine.server_info.get('version')}) keeps "
                "retracted requests' KV, so its prefix cache is not flushed after a "
                "retract-mode sync; stale prefixes may be reused until it is flushed"), report)
            return "skipped: engine keeps retracted KV"
        return None

    def end_and_continue(self, engines: list[EngineSession], sent: list[EngineCall],
                         watch: Watch, report: SyncReport | None = None) -> list[EngineCall]:
        """End and continue back to back in every lane (no trainer hop); waits for the
        ends (each with its deadline), returns the continues (answered after the sync)."""
        ends = self.submit_end(engines)
        sent += ends
        resumed = self.submit_continue(engines, ends, report)
        sent += resumed
        _wait(watch, ends)  # a failure names the engine and the step
        return resumed

    def end_flush_verify(self, engines: list[EngineSession], folded: frozenset[str],
                         answers: LastAnswers, report: SyncReport, steps: StepClock,
                         sent: list[EngineCall], watch: Watch) -> None:
        """The old order (a separate flush, or a version to read from `/model_info`): end,
        flush, verify, each through the lanes and waited on with its call type's deadline."""
        with steps("end"):
            ends = self.submit_end(engines)
            sent += ends
            _wait(watch, ends)
        with steps("flush"):
            self.flush(engines, folded, answers.refused, report, watch, sent)
        with steps("verify"):
            checks = [_call(e, "verify_weight_version", lambda e: e.verify_steps(answers.version))
                      for e in engines if not answers.version_set(e)]
            sent += checks
            _wait(watch, checks)

    def flush(self, engines: list[EngineSession], folded: frozenset[str],
              refused: dict[str, str], report: SyncReport, watch: Watch | None = None,
              sent: list[EngineCall] | None = None) -> None:
        """The flush rule on every engine; with a `watch`, through the lanes (each call with
        its deadline), else at once (nothing but folded answers to read)."""
        def flush(engine: EngineSession) -> Steps[None]:
            skip = self.flush_plan(engine, report)
            if skip is not None:
                report.flush[engine.url] = skip
                return
            if engine.url in folded:
                ok, why = engine.url not in refused, refused.get(engine.url, "")
            else:
                try:
                    ok = yield from engine.try_flush_steps()
                    why = "the engine was not idle"
                except EngineError as e:
                    ok, why = False, str(e)
            if ok:
                report.flush[engine.url] = "flushed"
            else:
                report.flush[engine.url] = f"refused: {why}"
                report.warnings.append(f"engine {engine.url} refused the cache flush after the "
                                       "new weights landed; its prefix cache may be stale")

        if watch is None:
            on_all(engines, "flush_cache", lambda e: drive(flush(e)))
            return
        calls = [_call(e, "flush_cache", flush) for e in engines]
        if sent is not None:
            sent += calls
        _wait(watch, calls)

    def undo(self, engines: list[EngineSession], sent: Sequence[EngineCall] = (), *,
             resume: bool = True) -> list[tuple[str, str]]:
        """Every engine's session put back: its update closed and (when `resume`) its pause
        lifted; [(url, problem)] for those it failed on. Calls already queued in the lanes
        are waited for first (bounded), so none lands after the undo."""
        settle(sent, self.config.http_timeout_s)
        problems: list[tuple[str, str]] = []
        lock = threading.Lock()

        def undo(engine: EngineSession) -> None:
            found = engine.undo(resume=resume, timeout=self.config.http_timeout_s)
            with lock:
                problems.extend((engine.url, p) for p in found)

        if resume:  # the paused engines smg reaches: one request (each session records it)
            calls = plane_calls([e for e in engines if e.paused is not None and not e.in_update],
                                "continue_generation", {},
                                on_answer=EngineSession.record_continued,
                                timeout=self.config.http_timeout_s)
            for call in {id(c): c for c in calls.values()}.values():
                call.run()
        todo = [e for e in engines if e.in_update or (resume and e.paused is not None)]
        if todo:
            with contextlib.suppress(WeightSyncError):
                on_all(todo, "undo", undo)
        return problems


class LastAnswers:
    """Each engine's answer to its last update: whether it now serves the version, and
    whether the flush folded into that update was refused (the weights landed anyway)."""

    def __init__(self, version: str):
        self.version = version
        self.answers: dict[str, Any] = {}
        self.refused: dict[str, str] = {}

    def record(self, url: str, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        answer = future.result()
        self.answers[url] = answer
        if isinstance(answer, dict) and answer.get("flush_refused"):
            self.refused[url] = str(answer.get("message", ""))

    def version_set(self, engine: EngineSession) -> bool:
        answer = self.answers.get(engine.url)
        message = answer.get("message", "") if isinstance(answer, dict) else ""
        return f"Weight version updated to {self.version}" in str(message)


def _reported(calls: dict[str, PlaneCall], report: SyncReport | None) -> None:
    """Each call's reached engines into `report.via_rl_plane` once it is answered."""
    if report is None:
        return
    for call in {id(c): c for c in calls.values()}.values():
        call.future.add_done_callback(lambda f, step=call.path: report.via_rl_plane.setdefault(
            step, []).extend(sorted(f.result())))


def _call(engine: EngineSession, step: str, fn: Callable[[EngineSession], Steps[Any]],
          after: Sequence[Future] | None = None) -> EngineCall:
    """Queue fn(engine)'s steps in the engine's ordered lane (after everything queued before
    it), run by the engine-call loop (`engine/call_pool.py`)."""
    return EngineCall(engine, step, engine.submit_steps(fn, engine, after=after))


def _wait(watch: Watch, calls: list[EngineCall]) -> None:
    """Every call watched (its failure named, its deadline kept) until all answered."""
    for call in calls:
        watch.add(call)
    watch.wait_calls(calls)


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
        seconds = getattr(call.future, "seconds", None)
        if seconds is not None:
            step = call.step.removesuffix("_generation").removesuffix("_weight_update")
            out[step] = max(out.get(step, 0.0), seconds)
    updates = stats.buckets * max(1, len(stats.per_engine_http_s))
    if updates:
        out["update_mean"] = stats.http_s / updates
    return {k: round(v, 6) for k, v in out.items()}
