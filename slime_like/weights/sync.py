"""`WeightSync`: one API over every engine and transport, each update a transaction.

The transaction, per `update()` (its engine calls are in `control.py`):

  check_metadata  names/dtypes/shapes vs what was registered and what each engine's model
                  has; a mismatch raises before any engine is paused or any byte moves
  attach          (re)build the weight group if the engine set changed or a sync failed
  pause           every engine concurrently (`abort` | `retract` | `in_place`), except the
                  `quiet` ones: out of the router with nothing running (the caller says so)
  begin           `begin_weight_update` where the engine has it (sglang >= 0.5.21)
  transfer        the transport's buckets; the last update carries `weight_version`
  end             `end_weight_update`
  flush           abort: always; in_place: never; retract: where the engine frees retracted
                  requests' KV (sglang >= 0.5.23), else skipped with one warning; a refusal
                  is reported, not fatal (the weights already landed)
  verify          every engine's `/model_info` reports the new `weight_version`
  continue        every engine that was paused, in a `finally`

Every engine call goes through the engine's `EngineSession`, which remembers what it
changed, and has its call type's deadline (`engine/deadlines.py`): an engine past it while
the others answered is hung, and the sync fails naming it (`WeightSyncError.hung`) rather
than waiting for it; a sync the fleet settles that finds it hung before any update went out
leaves it behind instead, and lands on the others (`left_behind.py`, `SyncReport.hung`).
On failure the sessions undo what they changed: pending collectives
are aborted, open update sessions ended, every paused engine continued (or handed to the
caller), engines that stopped answering (silent to a ping, then to one three times as
long: a loaded host's slow answer is not a death) or hung are dropped (the next sync
rebuilds the group for the living; `take_dropped()` hands them to recovery), and the
`WeightSyncError` names the step and the engine.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any

from slime_like.engine.call_pool import all_done
from slime_like.engine.deadlines import CallClock
from slime_like.engine.fanout import on_all
from slime_like.engine.session import EngineSession
from slime_like.errors import ConfigError, WeightMetadataError, WeightSyncError
from slime_like.protocol import modes
from slime_like.protocol.buckets import Bucket, TensorMeta
from slime_like.protocol.weight_delta import REFUSED
from slime_like.weights.attach import (
    BucketPlan,
    EngineLike,
    ModelChecks,
    make_transport,
    metadata_list,
    session_for,
)
from slime_like.weights.control import Control, LastAnswers, round_trips, settle
from slime_like.weights.handshake import check_same_metadata
from slime_like.weights.left_behind import leave_behind
from slime_like.weights.members import LATE_PING_FACTOR, Members
from slime_like.weights.packing import WeightSource, as_source
from slime_like.weights.sync_config import (
    DEFAULT_BUFFER_BYTES,
    LOAD_FORMATS,
    PAUSE_MODES,
    TRANSPORTS,
    StepClock,
    SyncReport,
    WeightSyncConfig,
)
from slime_like.weights.transport import Payload, TransferStats, Transport
from slime_like.weights.watch import EngineCall, Watch

__all__ = ["DEFAULT_BUFFER_BYTES", "LOAD_FORMATS", "PAUSE_MODES", "TRANSPORTS", "SyncReport",
           "WeightSync", "WeightSyncConfig"]

log = logging.getLogger(__name__)

class WeightSync(Members):
    """Pushes weights from this process (trainer rank 0) into a set of engines."""

    def __init__(self, engines: Sequence[EngineLike],
                 config: WeightSyncConfig | None = None, **overrides: Any):
        self.config = config or WeightSyncConfig(**overrides)
        if config is not None and overrides:
            raise TypeError("pass either a WeightSyncConfig or keyword settings, not both")
        self.engines: list[EngineSession] = [session_for(e) for e in engines]
        urls = [e.url for e in self.engines]
        if len(set(urls)) != len(urls):
            raise ConfigError("engines", f"an engine is listed twice: {urls}")
        for e in self.engines:
            e.timeout = self.config.http_timeout_s
        self.dropped: list[EngineSession] = []
        self.transport: Transport | None = None
        self.weight_version: str | None = None
        self.last_report: SyncReport | None = None
        self._registered: list[TensorMeta] | None = None
        self._checked: list[TensorMeta] | None = None  # last metadata found equal to _registered
        self._models = ModelChecks(self._warn_once)
        self._probed: set[str] = set()
        self._plan = BucketPlan(int(self.config.update_weight_buffer_size))
        self._counter = 0
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        # Called with each step's name as it starts (progress displays, chaos runs).
        self.on_step: Callable[[str], None] | None = None
        self.control = Control(self.config, self._warn_once)
        # What each call type took on these engines lately: every call's deadline.
        self.clock = CallClock(self.config.deadlines, cap_s=self.config.http_timeout_s)
        self._unclocked: list[EngineCall] = []  # the last update's calls, for the clock

    # ---- set-up ------------------------------------------------------------------------------

    def _transport(self) -> Transport:
        if self.transport is None:
            self.transport = make_transport(self.config)
            self.transport.clock = self.clock
        return self.transport

    def _warn_once(self, key: str, message: str, report: SyncReport | None = None) -> None:
        if report is not None and message not in report.warnings:
            report.warnings.append(message)
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def attach(self, weights: Any = None, *, metadata: Any = None) -> None:
        """Register what every sync will send and connect to the engines (builds the group).

        Optional: the first `update()` attaches by itself. Give the model (or named
        tensors), or only its `metadata` ({name: (dtype, shape)} or TensorMetas).
        """
        with self._lock:
            if weights is not None:
                metadata = as_source(weights).metadata()
            if metadata is not None:
                self._registered = metadata_list(metadata)
            if self._registered is None:
                raise WeightMetadataError("attach needs the model or its metadata")
            self._connect(self._registered)

    def _connect(self, metas: list[TensorMeta], source: Any = None) -> None:
        """Probe new engines, check metadata against their models, build the group.

        A source that lays its buckets out itself (`ShardedWeights`: gathered straight into
        wire layout) gets no pack buffers reserved for it."""
        if not self.engines:
            raise WeightSyncError("attach", "no engines left to sync (all were dropped: "
                                  f"{[e.url for e in self.dropped]})")
        fresh = [e for e in self.engines if e.url not in self._probed]
        if fresh:
            on_all(fresh, "attach (GET /server_info)", lambda e: e.probe())
            self._probed.update(e.url for e in fresh)
        self._models.check_new(self.engines, metas,
                               every=self.config.transport is modes.Transport.DISK,
                               enabled=self.config.check_engine_metadata)
        self._transport().attach(self.engines)
        if not getattr(source, "buckets_in_wire_layout", False):
            self._transport().prepare(self._plan(metas))

    # ---- the transaction ------------------------------------------------------------------------

    def update(self, weights: Any, weight_version: str | None = None,
               engines: Sequence[EngineLike] | None = None,
               quiet: Collection[str] = ()) -> SyncReport:
        """Push `weights` (a model, named tensors or a WeightSource) into every engine.

        `engines` replaces the set to sync (the fleet passes the engines of this update);
        the weight group is rebuilt when the set changed. `quiet`: URLs of engines that no
        request can reach and that run none (the fleet holds a colocated engine out of the
        router from its memory resume to this sync); they are not paused or continued, two
        round trips fewer each. Only the caller can know it: an engine in the router may
        be sent a request at any moment.
        """
        with self._lock:
            if engines is not None:
                self._set_engines(engines)
            try:
                return self._update(weights, weight_version, frozenset(quiet))
            except WeightSyncError as e:
                # An engine refused a delta (not the base it holds): nothing of that bucket
                # changed, the base is forgotten, and the sync runs again in full. Only where
                # the failed sync resumed the engines: the fleet resumes its own, and its
                # next sync is full.
                if REFUSED not in str(e) or not self.config.resume_on_failure:
                    raise
                log.warning("an engine refused a weight delta; syncing in full: %s", e)
                return self._update(weights, weight_version, frozenset(quiet))

    def _update(self, weights: Any, weight_version: str | None,
                quiet: frozenset[str] = frozenset()) -> SyncReport:
        cfg = self.config
        version = weight_version or str(self._counter + 1)
        report = SyncReport(version, cfg.transport, cfg.pause_mode, [e.url for e in self.engines])
        steps = StepClock(report, self.on_step)
        start = time.perf_counter()
        source = as_source(weights)
        begin = getattr(source, "begin_sync", None)  # a source keeping a copy: now stale
        if begin is not None:
            begin()
        with steps("check_metadata"):
            metas = source.metadata()
            if not metas:
                raise WeightMetadataError("nothing to sync: the weights have no tensors")
            if self._registered is None:
                self._registered = metas
            if metas is not self._checked:  # a source that reuses its list is checked once
                check_same_metadata(self._registered, metas)
                self._checked = metas
        with steps("attach"):
            try:
                self._connect(metas, source)
            except WeightMetadataError:
                raise
            except Exception as e:  # e.g. an engine died between syncs: drop it, say so
                raise _untouched(self._failed(e, "attach", []), True) from e
        buckets = self._plan(metas)
        engines = list(self.engines)
        self._clock_answers()
        watch = Watch(cfg.http_timeout_s, self.clock)
        closing = Watch(cfg.http_timeout_s, self.clock)  # end, flush, verify: their own
        sent: list[EngineCall] = []      # control calls in the engines' lanes
        updates: list[EngineCall] = []   # the transfer's calls
        answering = engines              # after a failure: those that still answer
        resumed: list[EngineCall] = []   # continue_generation sent through the lanes
        hung: set[str] = set()           # found hung by a call's deadline
        failure: BaseException | None = None
        try:
            with steps("pause"):
                # Sent, not awaited: each engine's lane sends pause, then begin, then bucket
                # 1, each once the one before was answered, while the trainer packs bucket 1.
                control = self.control.pause_and_begin(engines, report, sent,
                                                       gated=self._transport().gated,
                                                       quiet=quiet)
                for c in sent:  # a failed pause fails the update, even if begin got through
                    watch.add(c)
            with steps("transfer"):
                while True:
                    stats = TransferStats()
                    folded = frozenset(e.url for e in engines if e.folds_flush
                                       and self.control.flush_plan(e, report) is None)
                    answers = LastAnswers(version)
                    try:
                        self._transfer(engines, source, buckets, version, watch, stats,
                                       folded, control, answers, updates)
                        break
                    except WeightSyncError as err:
                        rest = leave_behind(self, err, engines, sent, updates, source,
                                            report)
                        if rest is None:
                            raise
                    engines = answering = rest
                    control, watch = [], Watch(cfg.http_timeout_s, self.clock)
                    self._transport().attach(engines)  # the group without them (rebuilt)
                report.transfer = stats.as_dict()
            if self.control.can_pipeline_end(engines, folded, answers, report):
                # Every engine's last answer carries the new version and no separate flush is
                # due: end and continue go out back to back in each lane, no trainer hop.
                with steps("end"):
                    resumed = self.control.end_and_continue(engines, sent, closing, report)
                with steps("flush"):
                    self.control.flush(engines, folded, answers.refused, report)
                report.seconds["verify"] = 0.0  # the last update's answer said so
            else:
                self.control.end_flush_verify(engines, folded, answers, report, steps, sent,
                                              closing)
        except BaseException as e:
            failure = e
            error = WeightSyncError(steps.current, f"{type(e).__name__}: {e}")  # if clean-up fails
            hung = set(getattr(e, "hung", None) or ())
            # Every lane stopped before any queued call fails, and only then the hung
            # engines' calls cut: a failed call opens the gates it held (the first update
            # waits on every engine's begin), and no lane may send past them.
            EngineSession.cancel_all_pending(engines)
            for engine in engines:
                if engine.url in hung:
                    # Its call still waiting is cut: a pause a cut-off host receives only
                    # once its link returns would pause it after its resync.
                    engine.abort_waiting()
            # No control call in flight during the clean-up, but for a hung engine's: it
            # will not answer, and its lane is stopped (its undo is its recovery's).
            settle([c for c in sent if c.engine.url not in hung], cfg.http_timeout_s)
            # Only engines that still answer are undone: each call to a hung one would wait
            # out its timeout. The others are dropped, their undo left to whoever recovers them.
            # No update request went out (the lanes are quiet now): no engine's weights moved.
            untouched = all(getattr(c.future, "sent_at", None) is None for c in updates)
            answering = self._answering([e for e in engines if e.url not in hung])
            error = _untouched(self._failed(e, steps.current, answering), untouched)
        finally:
            self._unclocked = sent + watch.answered  # answered by the next update, if not now
            # The living engines resume first: finding out which engines died (pings with
            # a timeout) must not keep the healthy ones paused. A caller that routes engines
            # (the fleet) resumes them itself, after unrouting the unverified ones.
            problems = []
            if failure is None or cfg.resume_on_failure:
                with steps("continue"):
                    problems = self.control.undo(answering, resumed)
                    # A ping missed on a loaded host is not a death: a second, longer one
                    # (the answering engines already resumed, so only the trainer waits)
                    # lets a slow engine be undone and kept rather than dropped paused.
                    late = self._answering([e for e in engines if e not in answering
                                            and e.url not in hung], LATE_PING_FACTOR)
                    if late:  # what `_failed` did for the others: leave the group, undo
                        if self.transport is not None:
                            self.transport.abandon([e.url for e in late])
                        problems += self.control.undo(late)
                        answering = [e for e in engines if e in answering or e in late]
            else:
                error.paused = [e.url for e in engines if e.paused is not None]
                for engine in engines:
                    engine.paused = None  # handed over: the caller resumes them
            if problems and failure is None:  # landed, but an engine did not come back
                raise self._with_dead_dropped(WeightSyncError("continue_generation", "; ".join(
                    f"{url}: {msg}" for url, msg in problems), problems[0][0]))
            if problems:
                log.error("after a failed sync, continue_generation also failed: %s", problems)
        if failure is not None:
            error.answering = [e.url for e in answering]
            raise self._with_dead_dropped(error, [e for e in engines if e not in answering]
                                          ) from failure
        self._counter += 1
        self.weight_version = version
        report.round_trips = round_trips(sent, stats)
        report.total_s = time.perf_counter() - start
        self.last_report = report
        return report

    def _transfer(self, engines: list[EngineSession], source: WeightSource,
                  buckets: list[Bucket], version: str, watch: Watch, stats: TransferStats,
                  folded: frozenset[str], control: list[EngineCall],
                  answers: LastAnswers, updates: list[EngineCall]) -> None:
        """Every payload the transport makes of the buckets, posted through every engine's
        session before the next is asked for; then every answer, or the first failure,
        blamed on the engine that most likely caused it.

        The first payload is packed while the engines pause and open their sessions, but
        no byte goes out before all of them answered: an engine that hangs there must not
        leave the others in a collective it will never join (gloo cannot abort one)."""
        transport = self._transport()
        payloads = transport.payloads(engines, source, buckets, version, watch, stats)
        # The first update waits for every engine's pause and begin, not only its own: an
        # engine that took it joins the broadcast, and one whose receive hangs on a peer
        # that never paused (gloo relays along a tree) would hold its scheduler until then.
        # One gate for all of them: each lane waiting on every call would cost N^2.
        every = [all_done([c.future for c in control])] if control else []
        own = {c.engine.url: [c.future] for c in control}
        posted: list[EngineCall] = []
        try:
            for payload in payloads:
                earlier = None if payload.after is None else all_done(
                    [c.future for p in payload.after for c in p.calls])
                payload.calls = [self._post(e, payload, version, e.url in folded,
                                            own.get(e.url, []) if posted else every,
                                            not posted, watch, stats, earlier)
                                 for e in engines]
                updates += payload.calls
                if not posted:
                    watch.wait_calls(control)
                posted += payload.calls
            if not posted:
                watch.wait_calls(control)
            t0 = time.perf_counter()
            watch.wait_calls(posted)
            stats.wait_s += time.perf_counter() - t0
            for call in posted:  # read here, not in callbacks: nothing of ours runs on a lane
                _timed(stats, call.engine.url, call.future)
            for call in posted[len(posted) - len(engines):]:  # the last payload's
                answers.record(call.engine.url, call.future)
        except Exception as e:
            payloads.close()  # its frames hold pending works, which keep rank 0's sockets open
            traceback.clear_frames(e.__traceback__)
            transport.failed()
            err = transport.explain(watch.explain(e))
            if err is e:
                raise
            raise err from e

    def _post(self, engine: EngineSession, payload: Payload, version: str, folded: bool,
              before: list[Future], first: bool, watch: Watch,
              stats: TransferStats, earlier: Future | None) -> EngineCall:
        """One payload into one engine's lane; the last one carries the version (and the
        flush, where it is folded into the update). `before`: the control calls it comes
        after (the first payload: every engine's; the others: the engine's own);
        `earlier`: done once the calls of the payloads it waits for (`payload.after`) are."""
        last = payload.last
        req = payload.request(engine, last and folded, version if last else None)
        after = list(before) if first and before else None
        if earlier is not None:  # not the lane's strict order: still after pause/begin
            after = [earlier, *before]
        future = engine.submit_steps(engine.update_steps, payload.verb, req,
                                     self.config.http_timeout_s, after=after)
        return watch.add(EngineCall(engine, payload.step, future))

    def _failed(self, exc: BaseException, step: str,
                engines: list[EngineSession]) -> WeightSyncError:
        """Clean up after a failed step; the error names the step (and the engine, if known)."""
        if self.transport is not None:
            self.transport.failed()
        EngineSession.cancel_all_pending(engines)
        self.control.undo(engines, resume=False)  # open update sessions closed
        if self.transport is not None:
            self.transport.abandon([e.url for e in engines])
        if isinstance(exc, WeightSyncError):
            return exc
        return WeightSyncError(step, f"{type(exc).__name__}: {exc}")

    def _clock_answers(self) -> None:
        """What the last update's calls took, into the clock: read at the next update's
        start, so that its continues (answered after it returned) count too, and nothing
        of the clock's runs while a transfer waits."""
        for call in self._unclocked:
            self.clock.record_answer(call.kind, call.future)
        self._unclocked = []

    # ---- teardown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy weight groups on the engines and release buffers."""
        with self._lock:
            if self.transport is not None:
                self.transport.close(self.engines)
                self.transport = None
            EngineSession.cancel_all_pending(self.engines + self.dropped)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _untouched(err: WeightSyncError, untouched: bool) -> WeightSyncError:
    """Say whether the failed sync sent any engine an update (the fleet keeps routing
    engines whose weights it never touched)."""
    err.untouched = untouched
    return err


def _timed(stats: TransferStats, url: str, future: Future) -> None:
    """An update's round trip into the transfer's stats, once answered (never if not sent)."""
    seconds = getattr(future, "seconds", None)
    if seconds is not None:
        stats.add_http(url, future.sent_at, seconds)

