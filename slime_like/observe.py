"""The operator's view of one run, behind three calls the training loop makes.

`RunObservers` bundles the report folder, the tracking backends and the console progress,
so `train.py` only says: an engine event happened (`on_event`), a step finished
(`log_step`), the run is over (`close`). Engine metrics addresses are read from the events
(each LOADED/STALE event carries the engine URL).
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

from slime_like.endpoints import MetricsEndpoint, metrics_endpoints
from slime_like.progress import RunProgress
from slime_like.report import RunReport
from slime_like.run_info import json_safe
from slime_like.tracking import Tracker, build_tracker

DEFAULT_STEPS = 10  # train.py's default when --num-rollout is not given


def expected_engines(args: argparse.Namespace) -> int | None:
    """Engines that serve HTTP in the nominal plan (what the launch display counts to)."""
    plan = getattr(args, "nominal_plan", None)
    try:
        return len(plan.http_engines()) if plan is not None else None
    except (AttributeError, TypeError):
        return None


class RunObservers:
    """Report, tracker and progress of one run; every call fans out to all three."""

    def __init__(self, report: RunReport, tracker: Tracker, progress: RunProgress):
        self.report = report
        self.tracker = tracker
        self.progress = progress
        self._engine_urls: dict[str, str] = {}
        self._router_urls: dict[str, str] = {}
        # Events come from recovery threads while the loop logs steps.
        self._lock = threading.Lock()

    @classmethod
    def from_args(cls, args: argparse.Namespace, out_dir: Path) -> RunObservers:
        """Build all three from the job's flags; saves config.json and versions.json."""
        # Tracking first: a missing optional package fails before the run folder exists.
        tracker = build_tracker(args, Path(out_dir), config=json_safe(args))
        report = RunReport(out_dir)
        report.save_run_info(args)
        progress = RunProgress(args.num_rollout or DEFAULT_STEPS, expected_engines(args))
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

    def on_event(self, engine: str, state: str, **details: Any) -> None:
        """An engine (or router) changed state: timeline, tracking, launch progress."""
        with self._lock:
            self._on_event(engine, state, details)

    def _on_event(self, engine: str, state: str, details: dict[str, Any]) -> None:
        self.report.log_event(engine, state, **details)
        self.tracker.log_event(engine, state, **details)
        url = details.get("url")
        if url and engine != "router" and state in ("LOADED", "STALE"):
            self._engine_urls[engine] = url
            self._refresh_endpoints()
        if state == "LOADED":
            self.progress.engine_ready(engine, f"{url}/metrics" if url else "")

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """A step finished: metrics.jsonl, tracking backends, the step display."""
        with self._lock:
            self.report.log_step(step, metrics)
            self.tracker.log_step(step, metrics)
            self.progress.step(step, metrics.get("reward_mean"))

    def close(self, title: str, notes: list[str] | None = None) -> Path:
        """Stop progress and tracking, render report.md; returns its path."""
        self.progress.close()
        self.tracker.close()
        return self.report.render(title=title, notes=notes)
