"""Engine health: how a death is noticed (a server's exit, failed probes), and the verdicts.

`HealthMonitor` finds dead engines fast without killing busy ones.

Two signals per engine, checked every `interval_s` for all engines concurrently:
- liveness (is the server process still running?) — a death is reported at once;
- readiness (a probe such as `/health_generate` with a timeout) — reported dead only after
  `failure_threshold` consecutive failures, and never during the `first_wait_s` grace after
  an engine (re)starts, so a cold compile is not mistaken for a hang (slime's default of 0 s
  kills engines during their first compile).
A hung probe never delays the others: each runs in its own worker with a deadline. With a
`CallClock`, a probe also has the deadline of its kind (what the engines' probes of that
kind took lately, at most the timeout): one still unanswered past it makes its engine
suspect at once (`on_suspect`), so the requests it holds go elsewhere long before the
probe's timeout; the probe still runs to its timeout to count as a failure.

The monitor holds health counters only; lifecycle decisions are the fleet's. It asks
whether to probe an engine now (`should_probe`: not a dead one) and reports: `on_suspect`
at the first failed probe, `on_healthy` when a suspect answers again, `on_dead` after N.
`FleetHealth` builds the monitor from the health slice and hands each finding to the fleet
as a `Verdict` (this engine is suspect, healthy again, dead), which the fleet applies under
its lock. Its exit watcher parks `wait_down` on every engine actor, so a server's death is
known the moment it starts (every thread of it exiting, before the kernel has freed its
memory: `cluster/exit_sighting.py`), probes or not.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_any
from dataclasses import dataclass, field
from typing import Any

import ray

from slime_like.config.fleet_slices import HealthSettings
from slime_like.engine.deadlines import CallClock
from slime_like.fleet.launcher import Launcher
from slime_like.fleet.lifecycle import PING_ONLY, WATCHED, ManagedEngine

logger = logging.getLogger(__name__)
# The reason of a death Ray reported for the actor itself (its node lost, its process
# killed), not an exit of the server it watched.
ACTOR_LOST = "engine actor lost"


@dataclass
class HealthPolicy:
    """How eagerly to call an engine dead (slime's flags: interval, timeout, first wait)."""

    interval_s: float = 5.0
    timeout_s: float = 10.0
    failure_threshold: int = 3
    first_wait_s: float = 30.0


@dataclass
class _Watched:
    since: float
    failures: int = 0


class HealthMonitor:
    """Watches engines by key; calls `on_dead(key, reason)` once per death."""

    def __init__(self, probe: Callable[[Hashable, float], None], is_alive: Callable[[Hashable], bool],
                 on_dead: Callable[[Hashable, str], None], policy: HealthPolicy | None = None, *,
                 should_probe: Callable[[Hashable], bool] | None = None,
                 on_suspect: Callable[[Hashable, str], None] | None = None,
                 on_healthy: Callable[[Hashable], None] | None = None,
                 alive_all: Callable[[list[Hashable]], dict[Hashable, bool]] | None = None,
                 clock: CallClock | None = None,
                 probe_kind: Callable[[Hashable], str] | None = None):
        self.probe = probe
        self.is_alive = is_alive
        # Liveness of a whole round at once (one round trip for the fleet), else per key.
        self.alive_all = alive_all
        self.on_dead = on_dead
        self.should_probe = should_probe or (lambda key: True)
        self.on_suspect = on_suspect or (lambda key, why: None)
        self.on_healthy = on_healthy or (lambda key: None)
        self.policy = policy or HealthPolicy()
        # What probes of each kind took lately, and so each probe's deadline (none: the
        # timeout alone decides).
        self.clock = clock
        self.probe_kind = probe_kind or (lambda key: "probe")
        self._engines: dict[Hashable, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A worker per engine probed at once (threads start only as needed): a round's
        # probes run side by side whatever the fleet's size, a hung one holding only its own.
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="health-probe")
        self._thread: threading.Thread | None = None
        self.rounds = 0  # rounds done, and the last rounds' wall times (what a round costs)
        self.round_seconds: deque[float] = deque(maxlen=256)

    # ---- membership ------------------------------------------------------------------------

    def watch(self, key: Hashable, *, grace: bool = True) -> None:
        """Start watching `key`; with `grace`, readiness failures are ignored for first_wait_s."""
        start = time.monotonic() if grace else time.monotonic() - self.policy.first_wait_s
        with self._lock:
            self._engines[key] = _Watched(since=start)

    def unwatch(self, key: Hashable) -> None:
        with self._lock:
            self._engines.pop(key, None)

    # ---- loop ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.policy.timeout_s + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(self.policy.interval_s):
            started = time.monotonic()
            try:
                self.check_once()
            except Exception:  # the monitor must outlive any one bad round
                logger.exception("health check round failed")
            self.rounds += 1
            self.round_seconds.append(time.monotonic() - started)

    def check_once(self) -> list[Hashable]:
        """One round over all engines; returns the keys declared dead in this round.

        Exited servers are reported before any readiness probe is waited on, so a hung
        probe of one engine never delays the report of another's death.
        """
        now = time.monotonic()
        with self._lock:
            engines = dict(self._engines)
        dead: list[Hashable] = []
        futures: dict[Hashable, tuple[Future, list[float], str]] = {}
        alive = self._alive_all(list(engines))
        for key, w in engines.items():
            if not alive.get(key, True):
                if self._declare_dead(key, "server process exited"):
                    dead.append(key)
                continue
            if now - w.since < self.policy.first_wait_s or not self._should_probe(key):
                continue
            started: list[float] = []
            futures[key] = (self._pool.submit(self._probe, key, started), started,
                            self.probe_kind(key))
        early = self._wait(futures)
        for key, (fut, _, _) in futures.items():
            try:
                ok, why = True, ""
                if not fut.done():
                    ok, why = False, f"probe timed out after {self.policy.timeout_s:.0f}s"
                else:
                    fut.result()
            except Exception as e:  # noqa: BLE001 - any probe failure counts
                ok, why = False, f"probe failed: {e}"
            with self._lock:
                w = self._engines.get(key)
                if w is None:
                    continue
                was_failing = w.failures > 0 or key in early
                w.failures = 0 if ok else w.failures + 1
                failures = w.failures
            if ok and was_failing:
                self.on_healthy(key)
            elif failures == 1 and key not in early:
                self.on_suspect(key, why)
            if failures >= self.policy.failure_threshold and self._declare_dead(
                    key, f"{failures} consecutive failed probes; last: {why}"):
                dead.append(key)
        return dead

    def _probe(self, key: Hashable, started: list[float]) -> float:
        started.append(time.monotonic())
        self.probe(key, self.policy.timeout_s)
        return time.monotonic() - started[0]

    def _wait(self, futures: dict[Hashable, tuple[Future, list[float], str]]) -> set[Hashable]:
        """Wait for the round's probes (at most the timeout); the engines whose probe went
        past its kind's deadline meanwhile are suspect at once: returned, `on_suspect`
        called. A probe answered in time teaches the clock how long its kind takes."""
        end = time.monotonic() + self.policy.timeout_s + 1.0
        early: set[Hashable] = set()
        pending = dict(futures)
        while pending and time.monotonic() < end:
            wait_any([f for f, _, _ in pending.values()], return_when=FIRST_COMPLETED,
                     timeout=min(0.05, max(0.0, end - time.monotonic())))
            now = time.monotonic()
            for key, (fut, started, kind) in list(pending.items()):
                if fut.done():
                    del pending[key]
                    if self.clock is not None and fut.exception() is None:
                        self.clock.record(kind, fut.result())
                elif self.clock is not None and key not in early and started and \
                        now - started[0] > (limit := self.clock.deadline(kind)) and \
                        limit < self.clock.cap_s:
                    early.add(key)
                    self.on_suspect(key, f"no answer to its {kind} probe within {limit:.2f}s "
                                         f"(its deadline: {self.clock.basis(kind)})")
        return early

    def _declare_dead(self, key: Hashable, reason: str) -> bool:
        """Stop watching `key` and call on_dead once; False if it was already gone."""
        with self._lock:
            if self._engines.pop(key, None) is None:
                return False
        logger.warning("engine %s is dead: %s", key, reason)
        self.on_dead(key, reason)
        return True

    def _should_probe(self, key: Hashable) -> bool:
        try:
            return bool(self.should_probe(key))
        except Exception:  # noqa: BLE001 - an engine we cannot ask about is probed
            return True

    def _alive_all(self, keys: list[Hashable]) -> dict[Hashable, bool]:
        if self.alive_all is not None and keys:
            try:
                return self.alive_all(keys)
            except Exception:  # noqa: BLE001 - ask one by one instead
                logger.exception("liveness of the whole fleet failed; asking each engine")
        return {key: self._alive(key) for key in keys}

    def _alive(self, key: Hashable) -> bool:
        try:
            return bool(self.is_alive(key))
        except Exception:  # noqa: BLE001 - an actor that cannot answer is not alive
            return False


class Finding(enum.Enum):
    """What the health part found about one engine."""

    SUSPECT = "suspect"   # a first failed probe
    HEALTHY = "healthy"   # a suspect answers again
    DEAD = "dead"         # its server exited, or N probes failed


@dataclass(frozen=True)
class Verdict:
    """A finding about one engine, for the fleet to act on."""

    engine: ManagedEngine
    finding: Finding
    reason: str = ""
    seen_at: float = field(default_factory=time.time)  # when the health part found it


class FleetHealth:
    """The fleet's health monitor (none when `--use-fault-tolerance` is off) and exit
    watcher; each finding goes to `report` as a `Verdict`, never a move of its own."""

    def __init__(self, settings: HealthSettings, launcher: Launcher,
                 engines: list[ManagedEngine], report: Callable[[Verdict], None]):
        self.settings = settings
        self.launcher = launcher
        self.report = report
        self._by_id = {e.engine_id: e for e in engines}
        self.monitor: HealthMonitor | None = None
        self.closing = False
        # Parked `wait_down` calls on every engine actor: a server's death is known at once.
        self._exit_refs: dict[Any, tuple[ManagedEngine, int, Any]] = {}
        self._exit_lock = threading.Lock()
        self._exit_thread: threading.Thread | None = None

    def start(self) -> None:
        health, find = self.settings, self._by_id.__getitem__
        if not health.enabled:
            return
        self.monitor = HealthMonitor(
            lambda engine_id, timeout: self.launcher.probe(find(engine_id), timeout),
            lambda engine_id: self.launcher.alive(find(engine_id)),
            lambda engine_id, why: self.report(Verdict(find(engine_id), Finding.DEAD, why)),
            HealthPolicy(interval_s=health.interval_s, timeout_s=health.timeout_s,
                         failure_threshold=health.failure_threshold,
                         first_wait_s=health.first_wait_s),
            should_probe=lambda engine_id: find(engine_id).phase in WATCHED,
            on_suspect=lambda engine_id, why: self.report(
                Verdict(find(engine_id), Finding.SUSPECT, why)),
            on_healthy=lambda engine_id: self.report(Verdict(find(engine_id), Finding.HEALTHY)),
            alive_all=lambda ids: self.launcher.alive_all([find(i) for i in ids]),
            clock=CallClock(health.deadlines, cap_s=health.timeout_s),
            probe_kind=lambda engine_id: "ping" if find(engine_id).phase in PING_ONLY
            else "health_generate")
        for engine_id in self._by_id:
            self.monitor.watch(engine_id)
        self.monitor.start()

    def admit(self, e: ManagedEngine) -> None:
        """An engine added mid-run: known by id from now on (probed once `watch`ed; one
        that left stays known, so a probe already under way still finds it)."""
        self._by_id[e.engine_id] = e

    def watch(self, e: ManagedEngine) -> None:
        if self.monitor is not None:
            self.monitor.watch(e.engine_id)

    def unwatch(self, e: ManagedEngine) -> None:
        if self.monitor is not None:
            self.monitor.unwatch(e.engine_id)

    def stop(self) -> None:
        """No more verdicts: exits from now on are the shutdown's own."""
        self.closing = True
        if self.monitor is not None:
            self.monitor.stop()

    def watch_exit(self, e: ManagedEngine) -> None:
        """Park `wait_down` on each of the engine's actors; the watcher thread sees it return."""
        with self._exit_lock:
            for a in e.actors:
                self._exit_refs[a.wait_down.remote(None)] = (e, e.restarts, a)
        if self._exit_thread is None:
            self._exit_thread = threading.Thread(target=self._exit_watcher, name="engine-exits",
                                                 daemon=True)
            self._exit_thread.start()

    def _exit_watcher(self) -> None:
        while not self.closing:
            with self._exit_lock:
                refs = list(self._exit_refs)
            if not refs:
                time.sleep(0.1)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
            for ref in ready:
                with self._exit_lock:
                    e, generation, actor = self._exit_refs.pop(ref)
                try:
                    why = f"server process {ray.get(ref)}"
                except ray.exceptions.ActorUnavailableError:
                    # Its node is cut off, not dead (Ray says which once it decides): park
                    # the wait again; the probes judge the engine meanwhile.
                    time.sleep(0.5)
                    if e.restarts == generation and not self.closing:
                        with self._exit_lock:
                            self._exit_refs[actor.wait_down.remote(None)] = (e, generation, actor)
                    continue
                except Exception as err:  # noqa: BLE001 - the actor died with its node
                    why = f"{ACTOR_LOST}: {type(err).__name__}"
                if e.restarts == generation and not self.closing:
                    self.report(Verdict(e, Finding.DEAD, why))
