"""How busy the engines and the trainer are, and where each weight sync falls in time.

An asynchronous schedule exists to keep both sides busy, so the operator needs to see it:
`EngineUtilization` polls every engine's `/v1/loads` on a thread (one short GET per engine
per poll) and keeps, per engine, intervals of `busy` (at least one request running),
`idle`, `paused` (the engine says it is paused) and `down` (it did not answer); an idle
interval also says why no request ran (`idle_causes.py`: the client's view of the engine,
read right after its answer, when the job gives one), a busy one how full the engine's
slots were (`fill`: running / `max_running_requests`, averaged over its polls).
`TrainerUtilization` records the trainer's busy phases, marked by the job with
`with trainer.busy("train"):`. `RunUtilization` bundles both with the syncs' positions and
writes every closed interval to `utilization.jsonl` in the run folder, from which the
report draws `utilization.png` (also when re-rendered later).

Times are wall-clock seconds (`time.time()`), as the report's step and event rows are, so
the picture lines up with them; the file stores them as seconds since the run started.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_like.observe.idle_causes import ClientView, blame

if TYPE_CHECKING:  # only named in hints: `slime-like report` needs no engine client
    from slime_like.engine.session import EngineSession

    # What the engine set callable returns: handles (named by engine_id) or {name: handle}.
    EngineSet = Iterable[EngineSession] | Mapping[str, EngineSession]

logger = logging.getLogger(__name__)

BUSY, IDLE, PAUSED, DOWN = "busy", "idle", "paused", "down"
NOT_RUNNING = (IDLE, PAUSED)  # what counts as idle in the engine idle ratio
UTILIZATION_FILE = "utilization.jsonl"


@dataclass(frozen=True)
class Interval:
    """`subject` was in `state` from `start` to `end` (wall-clock seconds)."""

    subject: str
    state: str
    start: float
    end: float
    cause: str | None = None  # why an idle engine ran nothing (idle_causes.py)
    fill: float | None = None   # busy: mean share of its slots running (None: unknown)

    def overlap(self, since: float, until: float) -> float:
        """Seconds of this interval inside [since, until]."""
        return max(0.0, min(self.end, until) - max(self.start, since))


class UtilizationLog:
    """Appends closed intervals and syncs to utilization.jsonl (one JSON object a line).

    Rows: `{"kind": "engine"|"trainer", "subject", "state", "start_s", "end_s"}` and
    `{"kind": "sync", "version", "start_s", "end_s"}`, seconds since `origin`.
    """

    def __init__(self, path: Path, origin: float):
        self.path = Path(path)
        self.origin = origin
        self._lock = threading.Lock()

    def write(self, kind: str, start: float, end: float, **fields: Any) -> None:
        row = {"kind": kind, **fields, "start_s": round(start - self.origin, 4),
               "end_s": round(end - self.origin, 4)}
        try:
            with self._lock, self.path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        except OSError as e:  # the report loses a row; the run goes on
            logger.warning("cannot write %s: %s", self.path, e)


def read_utilization(path: Path) -> dict[str, list[dict]]:
    """utilization.jsonl split by kind: `engine`, `trainer`, `sync` rows (times in seconds)."""
    out: dict[str, list[dict]] = {"engine": [], "trainer": [], "sync": []}
    path = Path(path)
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
        out.setdefault(row.get("kind", ""), []).append(row)
    return out


class _Track:
    """One subject's intervals: closed ones in time order, and the one still open."""

    def __init__(self, subject: str, on_close: Callable[[Interval], None] | None):
        self.subject = subject
        self.closed: list[Interval] = []
        self._ends: list[float] = []  # closed[i].end, for bisect
        self.state: str | None = None
        self.cause: str | None = None
        self.since = 0.0
        self.last_seen = 0.0
        self._fills: list[float] = [0.0, 0]  # the open interval's sum of fills, polls
        self._on_close = on_close

    def mark(self, state: str, at: float, cause: str | None = None,
             fill: float | None = None) -> None:
        """`state` holds from `at` on (a repeat of the current state only extends it)."""
        if (state, cause) != (self.state, self.cause):
            self.close(at)
            self.state, self.cause, self.since = state, cause, at
        if fill is not None:
            self._fills[0] += fill
            self._fills[1] += 1
        self.last_seen = max(self.last_seen, at)

    def _fill(self) -> float | None:
        total, polls = self._fills
        return round(total / polls, 4) if polls else None

    def close(self, at: float) -> None:
        if self.state is not None and at > self.since:
            iv = Interval(self.subject, self.state, self.since, at, self.cause, self._fill())
            self.closed.append(iv)
            self._ends.append(at)
            if self._on_close is not None:
                self._on_close(iv)
        self.state = None
        self._fills = [0.0, 0]
        self.last_seen = max(self.last_seen, at)

    def forget_before(self, before: float, batch: int = 1024) -> None:
        """Drop closed intervals that ended before `before` (they stay in the file); in
        batches, so a long run's memory stays bounded without copying the list each poll."""
        n = bisect.bisect_right(self._ends, before)
        if n >= batch:
            del self.closed[:n], self._ends[:n]

    def intervals(self, since: float, until: float) -> list[Interval]:
        """Intervals overlapping [since, until]; the open one reaches its last observation."""
        first = bisect.bisect_right(self._ends, since)
        out = [iv for iv in self.closed[first:] if iv.start < until]
        if self.state is not None and self.last_seen > self.since:
            out.append(Interval(self.subject, self.state, self.since, self.last_seen,
                                self.cause, self._fill()))
        return [iv for iv in out if iv.overlap(since, until) > 0]


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def engine_state(loads: dict) -> str:
    """busy / idle / paused from one `/v1/loads` answer (all its DP ranks together)."""
    entries = loads.get("loads") or []
    if any(e.get("paused") for e in entries):
        return PAUSED
    return BUSY if sum(int(e.get("num_running_reqs") or 0) for e in entries) >= 1 else IDLE


def engine_fill(loads: dict) -> float | None:
    """Running requests / `max_running_requests` (all DP ranks), None when it is not said."""
    entries = loads.get("loads") or []
    slots = sum(int(e.get("max_running_requests") or 0) for e in entries)
    running = sum(int(e.get("num_running_reqs") or 0) for e in entries)
    return running / slots if slots > 0 else None


def engine_queued(loads: dict) -> int:
    """Requests waiting in the engine's own queue (all its DP ranks together)."""
    return sum(int(e.get("num_waiting_reqs") or 0) for e in loads.get("loads") or [])


class EngineUtilization:
    """Samples every engine's load on a thread; busy/idle/paused/down intervals per engine.

    `engines` is called each poll (e.g. `lambda: fleet.handles()`), so engines may come and
    go; it returns handles (rows named by `engine_id`) or a {name: handle} mapping. One that leaves the set has its interval closed. An engine whose `/v1/loads` fails
    `down_after` polls in a row is `down` from its first failed poll (one slow answer on a
    loaded machine is not a death). Intervals older than `keep_s` leave memory (the file
    keeps them). Nothing here raises into the job. `client(engine)`, read right after the
    engine's answer, is what the rollout client holds for it: an idle interval then names
    its cause (`idle_causes.blame`).
    """

    def __init__(self, engines: Callable[[], EngineSet], *, interval_s: float = 0.05,
                 timeout_s: float | None = None, down_after: int = 3,
                 log: UtilizationLog | None = None, clock: Callable[[], float] = time.time,
                 max_workers: int = 8, keep_s: float = 3600.0,
                 client: Callable[[str], ClientView | None] | None = None):
        if interval_s <= 0:
            raise ValueError(f"EngineUtilization: interval_s must be > 0, got {interval_s}")
        self._engines = engines
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else max(0.02, 0.8 * interval_s)
        self.down_after = max(1, down_after)
        self.keep_s = keep_s
        self._log = log
        self._clock = clock
        self._client = client
        self._tracks: dict[str, _Track] = {}
        self._failing: dict[str, tuple[int, float]] = {}  # engine -> (failed polls, first at)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="engine-utilization")
        self.polls = 0

    def _closed(self, iv: Interval) -> None:
        if self._log is not None:
            extra = {"cause": iv.cause} if iv.cause else {}
            if iv.fill is not None and iv.state == BUSY:
                extra["fill"] = iv.fill
            self._log.write("engine", iv.start, iv.end, subject=iv.subject, state=iv.state,
                            **extra)

    def _ask(self, engine: str, handle: EngineSession
             ) -> tuple[str, int, ClientView | None, float | None, int] | None:
        """(state, requests queued in the engine, the client's view of it, its fill,
        requests it holds), or None."""
        try:
            loads = handle.loads(timeout=self.timeout_s) or {}
        except Exception:  # noqa: BLE001 - any failure to answer is "no answer"
            return None
        view = None
        if self._client is not None:
            try:
                view = self._client(engine)
            except Exception as e:  # noqa: BLE001 - the client's view is only for blame
                logger.debug("client view of %s unavailable: %s", engine, e)
        held = sum(int(e.get("num_running_reqs") or 0) + int(e.get("num_waiting_reqs") or 0)
                   for e in loads.get("loads") or [])
        return engine_state(loads), engine_queued(loads), view, engine_fill(loads), held

    def poll_once(self) -> None:
        """One poll of every engine (the thread calls it every `interval_s`)."""
        try:
            found = self._engines()
            handles = ({str(k): h for k, h in found.items()} if isinstance(found, Mapping)
                       else {str(h.engine_id): h for h in found})
        except Exception as e:  # noqa: BLE001 - the engine set is the fleet's; try again later
            logger.debug("engine set unavailable: %s", e)
            return
        at = self._clock()
        answers = dict(zip(handles, self._pool.map(self._ask, handles, handles.values()),
                           strict=True))
        queued = {e: a[1] for e, a in answers.items() if a is not None}
        held = sum(a[4] for a in answers.values() if a is not None)
        with self._lock:
            for engine, answer in answers.items():
                track = self._tracks.setdefault(engine, _Track(engine, self._closed))
                if answer is not None:
                    state, _, view, fill, _ = answer
                    self._failing.pop(engine, None)
                    cause = (blame(engine, queued, view, was_paused=track.state == PAUSED,
                                   held=held) if state == IDLE else None)
                    track.mark(state, at, cause, fill if state == BUSY else None)
                    continue
                failed, first = self._failing.get(engine, (0, at))
                self._failing[engine] = (failed + 1, first)
                if failed + 1 >= self.down_after:
                    track.mark(DOWN, max(first, track.since) if track.state != DOWN else at)
                    track.last_seen = max(track.last_seen, at)
            for engine, track in self._tracks.items():
                if engine not in handles and track.state is not None:
                    track.close(at)
                    self._failing.pop(engine, None)
                track.forget_before(at - self.keep_s)
            self.polls += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 - a sampler bug must not end the run
                logger.warning("engine utilization poll failed: %s", e)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> EngineUtilization:
        """Start polling on a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-utilization",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling, join the thread, close every open interval (written to the log)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 4 * self.timeout_s))
        self._pool.shutdown(wait=True)
        with self._lock:
            for track in self._tracks.values():
                if track.state is not None:
                    track.close(track.last_seen)

    def intervals(self, since: float = 0.0, until: float = float("inf"),
                  engine: str | None = None) -> list[Interval]:
        """Every engine's intervals overlapping [since, until], by engine then time."""
        with self._lock:
            tracks = [t for e, t in sorted(self._tracks.items()) if engine in (None, e)]
            return [iv for t in tracks for iv in t.intervals(since, until)]

    def idle_ratio(self, since: float, until: float, engine: str | None = None) -> float | None:
        """Time with no request running / time observed, over all engines (or one).

        Time observed excludes `down`: an engine that cannot answer is neither busy nor
        idle. Engines are pooled, i.e. averaged weighted by the time each was observed.
        None when nothing was observed in the window.
        """
        observed = idle = 0.0
        for iv in self.intervals(since, until, engine):
            if iv.state == DOWN:
                continue
            seconds = iv.overlap(since, until)
            observed += seconds
            if iv.state in NOT_RUNNING:
                idle += seconds
        return _ratio(idle, observed)

    def state_of(self, engine: str) -> str | None:
        """The engine's current state (None when never seen or gone)."""
        with self._lock:
            track = self._tracks.get(engine)
            return track.state if track else None


class TrainerUtilization:
    """The trainer's busy phases, marked by the job; idle = time in no phase."""

    SUBJECT = "trainer"

    def __init__(self, log: UtilizationLog | None = None,
                 clock: Callable[[], float] = time.time):
        self._log = log
        self._clock = clock
        self._phases: list[Interval] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def busy(self, phase: str = "train") -> Iterator[None]:
        """Mark the block as one busy phase of the trainer (recorded even if it raises)."""
        start = self._clock()
        try:
            yield
        finally:
            self.record(phase, start, self._clock())

    def record(self, phase: str, start: float, end: float) -> None:
        """A busy phase measured elsewhere (e.g. inside a Ray actor)."""
        if end <= start:
            return
        iv = Interval(self.SUBJECT, phase, start, end)
        with self._lock:
            bisect.insort(self._phases, iv, key=lambda i: i.start)
        if self._log is not None:
            self._log.write("trainer", start, end, subject=self.SUBJECT, state=phase)

    def phases(self, since: float = 0.0, until: float = float("inf")) -> list[Interval]:
        with self._lock:
            return [iv for iv in self._phases if iv.overlap(since, until) > 0]

    def idle_ratio(self, since: float, until: float) -> float | None:
        """Time in no busy phase / (until - since); overlapping phases count once."""
        busy, reached = 0.0, since
        for iv in self.phases(since, until):
            start, end = max(iv.start, reached), min(iv.end, until)
            if end > start:
                busy += end - start
                reached = end
        return _ratio(until - since - busy, until - since)


class RunUtilization:
    """Engines, trainer and syncs of one run, written to the run folder's utilization.jsonl.

    The job builds it once (`RunObservers.start_utilization`), marks trainer phases with
    `trainer.busy(...)`, calls `record_sync` after each sync and `step_metrics` per step.
    """

    def __init__(self, engines: Callable[[], EngineSet], run_dir: Path,
                 origin: float, *, interval_s: float = 0.05, timeout_s: float | None = None,
                 clock: Callable[[], float] = time.time,
                 client: Callable[[str], ClientView | None] | None = None):
        self.log = UtilizationLog(Path(run_dir) / UTILIZATION_FILE, origin)
        self.engines = EngineUtilization(engines, interval_s=interval_s, timeout_s=timeout_s,
                                         log=self.log, clock=clock, client=client)
        self.trainer = TrainerUtilization(log=self.log, clock=clock)
        self.syncs: list[tuple[float, float, str]] = []
        self._clock = clock

    def start(self) -> RunUtilization:
        self.engines.start()
        return self

    def stop(self) -> None:
        self.engines.stop()

    def record_sync(self, start: float, end: float, version: Any) -> None:
        """One weight sync from `start` to `end` (wall clock) that made `version` live."""
        self.syncs.append((start, end, str(version)))
        self.log.write("sync", start, end, version=str(version))

    def step_metrics(self, since: float, until: float | None = None,
                     samples: int | None = None) -> dict[str, float]:
        """`engine_idle_ratio` and `trainer_idle_ratio` over [since, until] (until: now), and
        `samples_per_s` when the step's trained `samples` are given; a ratio with nothing
        observed is left out."""
        until = self._clock() if until is None else until
        out = {"engine_idle_ratio": self.engines.idle_ratio(since, until),
               "trainer_idle_ratio": self.trainer.idle_ratio(since, until)}
        if samples is not None and until > since:
            out["samples_per_s"] = round(samples / (until - since), 4)
        return {k: v for k, v in out.items() if v is not None}


def run_idle_ratios(rows: dict[str, list[dict]]) -> dict[str, float | None]:
    """Both idle ratios over a whole run, from `read_utilization`'s rows.

    The window is the time the rows cover (from the first interval written to the last):
    the engine ratio pools every engine's non-down time, the trainer's is the time in no
    busy phase over that window.
    """
    engine_rows, trainer_rows = rows.get("engine", []), rows.get("trainer", [])
    observed = sum(r["end_s"] - r["start_s"] for r in engine_rows if r.get("state") != DOWN)
    idle = sum(r["end_s"] - r["start_s"] for r in engine_rows if r.get("state") in NOT_RUNNING)
    covered = engine_rows + trainer_rows
    out: dict[str, float | None] = {"engine_idle_ratio": _ratio(idle, observed),
                                    "trainer_idle_ratio": None}
    if covered and trainer_rows:
        trainer = TrainerUtilization()
        for r in trainer_rows:
            trainer.record(str(r.get("state")), r["start_s"], r["end_s"])
        since = min(r["start_s"] for r in covered)
        until = max(r["end_s"] for r in covered)
        out["trainer_idle_ratio"] = trainer.idle_ratio(since, until)
    return out
