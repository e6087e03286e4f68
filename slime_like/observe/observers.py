"""The operator's view of one run, behind three calls the job makes.

`RunObservers` bundles the report folder, the tracking backends and the console progress,
so the job only says: the fleet did something (`on_event`, a `FleetEvent`), a step finished
(`log_step`), the run is over (`close`). Engine metrics addresses are read from the events
(each LOADED/STALE event carries the engine URL).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from slime_like.config.slices import ObserveSettings
from slime_like.fleet.events import EngineState, FleetEvent
from slime_like.observe.endpoints import MetricsEndpoint, metrics_endpoints
from slime_like.observe.idle_causes import ClientView
from slime_like.observe.progress import RunProgress
from slime_like.observe.report import RunReport
from slime_like.observe.run_info import json_safe
from slime_like.observe.tracking import Tracker, build_tracker
from slime_like.observe.utilization import RunUtilization

# Events whose `url` is where an engine serves (and its /metrics).
_SERVING_AT = (EngineState.LOADED, EngineState.STALE)


class RunObservers:
    """Report, tracker and progress of one run; every call fans out to all three."""

    def __init__(self, report: RunReport, tracker: Tracker, progress: RunProgress):
        self.report = report
        self.tracker = tracker
        self.progress = progress
        self.utilization: RunUtilization | None = None
        self._engine_urls: dict[str, str] = {}
        self._router_urls: dict[str, str] = {}
        # Events come from recovery threads while the loop logs steps.
        self._lock = threading.Lock()

    @classmethod
    def start(cls, settings: ObserveSettings, out_dir: Path) -> RunObservers:
        """Build all three for a new run; saves config.json and versions.json."""
        config = json_safe(settings.flags)
        # Tracking first: a missing optional package fails before the run folder exists.
        tracker = build_tracker(settings.tracking, Path(out_dir), config=config)
        report = RunReport(out_dir)
        report.begin_run()
        report.save_run_info(config)
        progress = RunProgress(settings.num_steps, settings.expected_engines)
        obs = cls(report, tracker, progress)
        if tracker.metrics_url:
            progress.say(f"job metrics: {tracker.metrics_url}")
        obs._refresh_endpoints()
        return obs

    def _refresh_endpoints(self) -> None:
        self.report.endpoints = metrics_endpoints(self._engine_urls, self._router_urls,
                                                  self.tracker.metrics_url)

    @property
    def endpoints(self) -> list[MetricsEndpoint]:
        """Every `/metrics` address known so far (job, routers, engines)."""
        return self.report.endpoints

    def add_router(self, model: str, metrics_url: str) -> None:
        """The router's Prometheus address (it serves metrics on a port of its own)."""
        with self._lock:
            self._router_urls[model] = metrics_url
            self._refresh_endpoints()
        self.progress.say(f"router {model} metrics: {metrics_url}")

    def on_event(self, event: FleetEvent) -> None:
        """The fleet did something: timeline, tracking, launch progress."""
        with self._lock:
            self.report.log_event(event)
            self.tracker.log_event(event)
            url = event.details.get("url")
            if url and event.kind in _SERVING_AT:
                self._engine_urls[event.subject] = url
                self._refresh_endpoints()
            if event.kind is EngineState.LOADED:
                self.progress.engine_ready(event.subject, f"{url}/metrics" if url else "")

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """A step finished: metrics.jsonl, tracking backends, the step display."""
        with self._lock:
            self.report.log_step(step, metrics)
            self.tracker.log_step(step, metrics)
            self.progress.step(step, metrics.get("reward_mean"))

    def start_utilization(self, engines: Callable[[], Iterable[Any]],
                          interval_s: float = 0.05,
                          client: Callable[[str], ClientView | None] | None = None
                          ) -> RunUtilization:
        """Start sampling engine load (`engines()` read each poll: the `EngineSession`s to
        watch); the trainer's phases and the syncs are marked on what it returns. Written
        to utilization.jsonl, drawn as utilization.png; stopped by `close`. `client(engine)`:
        what the rollout client holds for an engine, which an idle interval is blamed on."""
        if self.utilization is None:
            self.utilization = RunUtilization(engines, self.report.out_dir, self.report.started,
                                              interval_s=interval_s, client=client).start()
        return self.utilization

    def close(self, title: str, notes: list[str] | None = None) -> Path:
        """Stop progress and tracking, render report.md; returns its path."""
        if self.utilization is not None:
            self.utilization.stop()
        self.progress.close()
        self.tracker.close()
        return self.report.render(title=title, notes=notes)
