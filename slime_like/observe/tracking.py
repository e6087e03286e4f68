"""Experiment tracking: wandb, TensorBoard and the job's own Prometheus endpoint.

One `Tracker` fans each step's metrics and each engine event out to the backends the flags
enabled; with none enabled it is a no-op, so the training loop never asks which are on.
wandb and tensorboard are optional packages: looked up only when their flag is set, and a
missing one is a one-line error that says what to install.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from slime_like.config.slices import TrackingSettings
from slime_like.errors import ConfigError
from slime_like.fleet.events import FleetEvent, kind_of
from slime_like.observe.async_metrics import COUNTS, STALENESS, as_histogram, for_scalar_backends
from slime_like.observe.incidents import IncidentLog
from slime_like.protocol.modes import AsyncMode

logger = logging.getLogger(__name__)


class TrackingError(ConfigError):
    """A tracking flag cannot be honoured (a missing package, a port in use)."""


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite entries of a step's metrics (nested dicts flattened with '/')."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in scalars(value).items()})
        elif isinstance(value, int | float) and not isinstance(value, bool) \
                and math.isfinite(value):
            out[key] = float(value)
    return out


class Backend(Protocol):
    """One tracking destination."""

    name: str

    def log_step(self, step: int, values: dict[str, float]) -> None:
        """Record one step's scalars."""

    def log_event(self, event: dict[str, Any]) -> None:
        """Record one fleet event as a timeline row (`engine`, `state`, `time_s`, details)."""

    def close(self) -> None:
        """Flush and release what the backend holds (files, a server, a run)."""

    # Optional: `log_async(step, metrics)` gets the step's raw metrics (the staleness
    # histogram as a dict, the mode as a string) where a backend can show more than scalars.


class TensorBoardBackend:
    """Scalars per step and non-routine engine events as text, via torch's SummaryWriter."""

    name = "tensorboard"

    def __init__(self, log_dir: Path):
        if importlib.util.find_spec("tensorboard") is None:
            raise TrackingError("--use-tensorboard",
                                "the tensorboard package is not installed: pip install tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self._step = 0

    def log_step(self, step: int, values: dict[str, float]) -> None:
        self._step = step
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_async(self, step: int, metrics: dict[str, Any]) -> None:
        """The staleness histogram as a TensorBoard histogram of span ages."""
        hist = as_histogram(metrics.get(STALENESS))
        if hist:
            import numpy as np

            ages = np.repeat(np.array(list(hist), dtype=np.float64), list(hist.values()))
            self.writer.add_histogram(STALENESS, ages, step)
            self.writer.flush()

    def log_event(self, event: dict[str, Any]) -> None:
        details = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("engine", "state"))
        self.writer.add_text(f"engines/{event['engine']}", f"{event['state']} {details}".strip(),
                             self._step)

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A wandb run; `mode="offline"` writes it under `dir` without touching the network."""

    name = "wandb"

    def __init__(self, *, project: str, group: str | None, mode: str | None, dir: Path,
                 config: dict[str, Any] | None = None, name: str | None = None):
        try:
            import wandb
        except ImportError:
            raise TrackingError("--use-wandb",
                                "the wandb package is not installed: pip install wandb") from None
        Path(dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, group=group, mode=mode, dir=str(dir),
                              config=config, name=name)
        self._counts: dict[str, int] = {}
        self._incidents = IncidentLog()

    def log_step(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_event(self, event: dict[str, Any]) -> None:
        # Into the run summary: wandb's step axis belongs to log_step.
        key = f"engine_events/{kind_of(event['state'], event['engine']).value}"
        self._counts[key] = self._counts.get(key, 0) + 1
        self.run.summary[key] = self._counts[key]
        outcome = self._incidents.feed(event)
        if outcome is not None and outcome[0] == "recovered":
            self.run.summary[f"engine_recovery_s/{event['engine']}"] = outcome[1].recovery_s

    def close(self) -> None:
        self.run.finish()


def advertised_host() -> str:
    """The address others reach this node at: SLIME_LIKE_HOST_IP, else the outbound interface's.

    Connecting a UDP socket sends nothing; it only asks the kernel which interface routes out.
    """
    if os.environ.get("SLIME_LIKE_HOST_IP"):
        return os.environ["SLIME_LIKE_HOST_IP"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _metric_name(key: str) -> str:
    """Prometheus spelling of a step metric: `sync_s` -> `slime_like_sync_seconds`."""
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    if name.endswith("_per_s"):
        return "slime_like_" + name[:-2] + "_second"
    return "slime_like_" + (name[:-2] + "_seconds" if name.endswith("_s") else name)


# Bucket bounds (versions behind) of the staleness histogram; ages above go to +Inf.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)


class PrometheusBackend:
    """The job's `/metrics`: step, every numeric step metric, engine states and recoveries.

    The asynchronous schedules' sample counts are counters (`..._total`, summed over the
    steps), the staleness a histogram of span ages, the schedule a 0/1 gauge per mode.
    """

    name = "prometheus"

    def __init__(self, port: int = 0, host: str = "0.0.0.0"):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            start_http_server,
        )

        self._gauge_cls = Gauge
        self.registry = CollectorRegistry()
        self._step_gauges: dict[str, Any] = {}
        # `node`: the host the engine runs on (a node's engines sum up by it at 64 engines)
        self.engine_state = Gauge("slime_like_engine_state", "1 for the state each engine is in",
                                  ["engine", "node", "state"], registry=self.registry)
        self.deaths = Counter("slime_like_engine_deaths", "Engine deaths", ["engine"],
                              registry=self.registry)
        self.recoveries = Counter("slime_like_engine_recoveries",
                                  "Engines serving again after a death", ["engine"],
                                  registry=self.registry)
        self.recovery_s = Gauge("slime_like_engine_recovery_seconds",
                                "Seconds from the last death to serving again", ["engine"],
                                registry=self.registry)
        self.sample_counts = {key: Counter(_metric_name(key), f"step metric {key}, summed",
                                           registry=self.registry) for key in COUNTS}
        self.staleness = Histogram("slime_like_staleness", "Versions between the trained "
                                   "version and each sample's oldest span", registry=self.registry,
                                   buckets=STALENESS_BUCKETS)
        self.async_mode = Gauge("slime_like_async_mode", "1 for the schedule the job runs",
                                ["mode"], registry=self.registry)
        self._states: dict[str, tuple[str, str]] = {}  # engine -> (state, node)
        self._incidents = IncidentLog()
        try:
            self.server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise TrackingError("--job-metrics-port", f"cannot serve on {host}:{port}: {e}") from None
        self.port = int(self.server.server_port)
        shown = advertised_host() if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{shown}:{self.port}/metrics"

    def _gauge(self, key: str):
        if key not in self._step_gauges:
            self._step_gauges[key] = self._gauge_cls(_metric_name(key), f"step metric {key}",
                                                     registry=self.registry)
        return self._step_gauges[key]

    def log_step(self, step: int, values: dict[str, float]) -> None:
        self._gauge("step").set(step)
        for key, value in values.items():
            if key in self.sample_counts:
                if value > 0:
                    self.sample_counts[key].inc(value)
            else:
                self._gauge(key).set(value)

    def log_async(self, step: int, metrics: dict[str, Any]) -> None:
        for age, count in as_histogram(metrics.get(STALENESS)).items():
            for _ in range(count):
                self.staleness.observe(age)
        mode = metrics.get("async_mode")
        if isinstance(mode, str) and mode:
            for known in (*AsyncMode, mode):
                self.async_mode.labels(mode=known).set(1 if known == mode else 0)

    def log_event(self, event: dict[str, Any]) -> None:
        engine, state = event["engine"], kind_of(event["state"], event["engine"]).value
        node = node_of(event) or (self._states.get(engine) or ("", ""))[1]
        old = self._states.get(engine)
        if old is not None and old != (state, node):
            self.engine_state.labels(engine=engine, node=old[1], state=old[0]).set(0)
        self.engine_state.labels(engine=engine, node=node, state=state).set(1)
        self._states[engine] = (state, node)
        outcome = self._incidents.feed(event)
        if outcome is None:
            return
        kind, incident = outcome
        if kind == "died":
            self.deaths.labels(engine=engine).inc()
        elif kind == "recovered":
            self.recoveries.labels(engine=engine).inc()
            self.recovery_s.labels(engine=engine).set(incident.recovery_s or 0.0)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Tracker:
    """Fans metrics and events out to the enabled backends; a no-op when none is enabled.

    A failing backend is logged once and dropped: tracking never stops a training run.
    """

    def __init__(self, backends: Iterable[Backend] = ()):
        self.backends: list[Backend] = list(backends)
        self._started = time.time()

    @property
    def enabled(self) -> bool:
        """Whether any backend is on; with none, every call returns at once."""
        return bool(self.backends)

    @property
    def metrics_url(self) -> str | None:
        """The job's Prometheus endpoint, when one is served."""
        return next((b.url for b in self.backends if isinstance(b, PrometheusBackend)), None)

    def _each(self, what: str, *call_args: Any) -> None:
        for b in list(self.backends):
            if not hasattr(b, what):  # an optional method this backend does not have
                continue
            try:
                getattr(b, what)(*call_args)
            except Exception as e:  # noqa: BLE001 - a tracking outage must not end the run
                logger.warning("tracking backend %s failed in %s (%s); disabling it", b.name,
                               what, e)
                self.backends.remove(b)

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """The step's numeric metrics to every backend."""
        if self.backends:
            self._each("log_step", step, scalars(for_scalar_backends(metrics)))
            self._each("log_async", step, metrics)

    def log_event(self, event: FleetEvent) -> None:
        """A fleet event to every backend, as a timeline row (its `state` the enum member)."""
        if self.backends:
            self._each("log_event", {"engine": event.subject, "state": event.kind,
                                     "time_s": round(event.at - self._started, 3),
                                     **event.row()})

    def close(self) -> None:
        """Close every backend; later calls are no-ops."""
        backends, self.backends = self.backends, []
        for b in backends:
            try:
                b.close()
            except Exception as e:  # noqa: BLE001 - close the others anyway
                logger.warning("tracking backend %s failed to close: %s", b.name, e)


def build_tracker(settings: TrackingSettings, run_dir: Path,
                  config: dict[str, Any] | None = None) -> Tracker:
    """The backends `--use-wandb`, `--use-tensorboard` and `--job-metrics-port` ask for."""
    run_dir = Path(run_dir)
    backends: list[Backend] = []
    try:
        if settings.job_metrics_port is not None:
            backends.append(PrometheusBackend(settings.job_metrics_port))
        if settings.use_tensorboard:
            backends.append(TensorBoardBackend(Path(settings.tensorboard_dir or
                                                    run_dir / "tensorboard")))
        if settings.use_wandb:
            backends.append(WandbBackend(
                project=settings.wandb_project, group=settings.wandb_group,
                mode=settings.wandb_mode, dir=Path(settings.wandb_dir or run_dir),
                config=config, name=run_dir.name))
    except BaseException:
        Tracker(backends).close()
        raise
    return Tracker(backends)


def node_of(event: dict[str, Any]) -> str | None:
    """The node an event places its engine on: its `node` detail, or its URL's host."""
    if event.get("node"):
        return str(event["node"])
    url = event.get("url")
    return urlparse(str(url)).hostname if url else None
