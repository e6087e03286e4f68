"""The run's report folder: metrics.jsonl, engine timeline, plots and report.md.

report.md is for an operator skimming a finished run: a summary first (steps, reward,
weight sync, each engine death and how long its recovery took), the metrics endpoints,
the plots (deaths and recoveries marked on them), then only the engine events that are not
routine (`fleet.events.ROUTINE`), in time order. Everything else stays in the JSONL files
beside it. A run into a folder that holds an earlier run's files moves them aside first
(`begin_run`), so a report, its timeline and its clock are one run's.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_like.fleet.events import FleetEvent, is_routine, kind_of, previous_of
from slime_like.observe import async_metrics
from slime_like.observe.endpoints import MetricsEndpoint
from slime_like.observe.fleet_view import endpoint_lines
from slime_like.observe.incidents import Incident, IncidentLog
from slime_like.observe.run_info import write_run_info
from slime_like.observe.utilization import UTILIZATION_FILE, read_utilization, run_idle_ratios

logger = logging.getLogger(__name__)

MAX_EVENT_ROWS = 30  # report.md stays short; engine_timeline.jsonl has every event
EARLIER_RUNS = "earlier-runs"  # where a new run moves an earlier run's files
# One run's own files (the logs, the model and checkpoints stay where they are).
RUN_FILES = ("metrics.jsonl", "engine_timeline.jsonl", "report.md", "endpoints.json",
             "chaos.json", "reward.png", "weight_sync.png", "engine_timeline.png",
             "utilization.jsonl", "utilization.png")


def sync_metrics(sync_report: dict[str, Any] | None) -> dict[str, Any]:
    """sync_s, the transport, sync_gbps where the transport reported the bytes it moved,
    sync_requests and sync_pack_s (the update requests per engine, the trainer's pack copy),
    and sync_not_paused: how many engines it updated without pausing (held out of the
    router, idle: colocated engines between their memory resume and the sync);
    sync_via_rl_plane: per control call, how many engines smg's RL plane reached."""
    if not sync_report:
        return {}
    seconds = float(sync_report.get("total_s", 0.0))
    out: dict[str, Any] = {"sync_s": round(seconds, 4)}
    if sync_report.get("transport"):
        out["sync_transport"] = sync_report["transport"]
    if "not_paused" in sync_report:
        out["sync_not_paused"] = len(sync_report["not_paused"])
    if sync_report.get("via_rl_plane"):  # `--router-enable-rl`: engines smg reached per call
        out["sync_via_rl_plane"] = {path: len(urls)
                                    for path, urls in sync_report["via_rl_plane"].items()}
    transfer = sync_report.get("transfer") or {}
    moved = transfer.get("bytes")
    if moved and seconds > 0:
        out["sync_gbps"] = round(moved / seconds / 1e9, 4)
        out["sync_gb"] = round(moved / 1e9, 4)
    if "quantize_s" in sync_report:  # an FP8 sync: the trainer's time quantizing
        out["sync_quantize_s"] = sync_report["quantize_s"]
    if transfer.get("buckets"):
        # Requests per engine, and the trainer's pack copy: 0 when the buckets went from
        # the trainer's own storage (flat weights that outlive the offload).
        out["sync_requests"] = int(transfer["buckets"])
        out["sync_pack_s"] = round(float(transfer.get("pack_s", 0.0)), 5)
    # Where the sync's time went, in ms: its steps, each engine round trip (slowest engine;
    # update_mean per bucket) and the trainer's host time building and waiting on requests.
    detail = {f"step_{k}": v for k, v in (sync_report.get("seconds") or {}).items()}
    detail |= {f"rt_{k}": v for k, v in (sync_report.get("round_trips") or {}).items()}
    detail |= {k: transfer[k] for k in ("prep_s", "wait_s", "first_call_s")
               if isinstance(transfer.get(k), int | float)}
    if detail:
        out["sync_detail_ms"] = {k.removesuffix("_s"): round(v * 1e3, 3) for k, v in detail.items()}
    return out


# Where a step's time goes, in step order (docs/COLOCATE.md): the keys of metrics.jsonl.
PHASES = (("trainer_offload", "trainer offload"), ("rollout", "generation"),
          ("trainer_onload", "trainer onload"), ("score", "scoring"), ("check", "logprob check"),
          ("engine_release", "engine release"), ("train", "training"),
          ("engine_resume", "engine resume"), ("sync", "sync"), ("step", "whole step"))


def phase_line(steps: list[dict]) -> str | None:
    """`- step phases (median): ...` with each phase's seconds and GB/s where bytes moved."""
    parts = []
    for key, label in PHASES:
        seconds = [r[f"{key}_s"] for r in steps if isinstance(r.get(f"{key}_s"), int | float)]
        if not seconds:
            continue
        part = f"{label} {_fmt(statistics.median(seconds))} s"
        rates = [r[f"{key}_gbps"] for r in steps if r.get(f"{key}_gbps")]
        if rates:
            part += f" ({_fmt(statistics.median(rates))} GB/s)"
        parts.append(part)
    return "- step phases (median): " + ", ".join(parts) if len(parts) > 1 else None


def step_at(t: float, steps: list[dict]) -> int | None:
    """The step running at time `t`: the first whose end (`time_s`) is not before `t`."""
    for row in steps:
        if row["time_s"] >= t:
            return int(row["step"])
    return None


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def summary_lines(steps: list[dict], incidents: list[Incident]) -> list[str]:
    """The summary bullets: what happened in a few lines."""
    lines = []
    if steps:
        lines.append(f"- steps: {len(steps)} ({steps[0]['step']}..{steps[-1]['step']}), "
                     f"wall time {steps[-1]['time_s']:.1f} s")
        rewards = [(r["step"], r["reward_mean"]) for r in steps if "reward_mean" in r]
        if rewards:
            best = max(rewards, key=lambda sr: sr[1])
            lines.append(f"- reward: {_fmt(rewards[0][1])} (step {rewards[0][0]}) → "
                         f"{_fmt(rewards[-1][1])} (step {rewards[-1][0]}); best {_fmt(best[1])} "
                         f"at step {best[0]}")
        syncs = [r["sync_s"] for r in steps if r.get("sync_s")]
        if syncs:
            line = f"- weight sync: {len(syncs)} syncs, median {_fmt(statistics.median(syncs))} s"
            rates = [r["sync_gbps"] for r in steps if r.get("sync_gbps")]
            if rates:
                line += f", median {_fmt(statistics.median(rates))} GB/s"
            lines.append(line)
        phases = phase_line(steps)
        if phases:
            lines.append(phases)
        lines += check_lines(steps)
    lines.append(f"- engine deaths: {len(incidents)}")
    for i in incidents:
        at = step_at(i.died_at, steps)
        where = f"at step {at} " if at is not None else ""
        why = f": {i.reason}" if i.reason else ""
        if i.recovery_s is not None:
            outcome = (f"recovered in {i.recovery_s:.1f} s"
                       + (f" (serving version {i.version})" if i.version else ""))
        else:
            outcome = f"NOT recovered ({i.failure})" if i.failure else "NOT recovered"
        lines.append(f"  - {i.engine} seen dead {where}(t {i.died_at:.1f} s{why}); {outcome}")
    return lines


def _numbers(steps: list[dict], key: str) -> list[float]:
    """The step values of `key` that are numbers (NaN and missing left out)."""
    return [float(r[key]) for r in steps
            if isinstance(r.get(key), int | float) and r[key] == r[key]]


def check_lines(steps: list[dict]) -> list[str]:
    """The log-probability check over the run: the noise per token (the median and p99
    steps, the largest token), tokens over the tolerance and where, the largest sample
    mean (what decides), and how often the probe confirmed each engine's version."""
    maxima = _numbers(steps, "logprob_max_abs_diff")
    if not maxima:
        return []
    medians, p99s = _numbers(steps, "logprob_diff_median"), _numbers(steps, "logprob_diff_p99")
    line = "- log-probability check: per token |engine - trainer|"
    if medians and p99s:
        line += (f" median {statistics.median(medians):.2g}, p99 {statistics.median(p99s):.2g}"
                 " (median step),")
    line += f" largest {max(maxima):.2g}"
    means = _numbers(steps, "logprob_sample_mean_diff_max")
    if means:
        line += f"; largest sample mean {max(means):.2g} (the decision)"
    lines = [line]
    over = [(r["step"], r["logprob_diff_over_tolerance"]) for r in steps
            if r.get("logprob_diff_over_tolerance")]
    if over:
        lines.append(f"  - {sum(n for _, n in over)} tokens over the tolerance in {len(over)} "
                     f"steps (first at step {over[0][0]}), none deciding a step alone")
    probed = [r for r in steps if r.get("logprob_probe_engines")]
    if probed:
        confirmed = sum(r.get("logprob_probe_confirmed", 0) for r in probed)
        asked = sum(r["logprob_probe_engines"] for r in probed)
        lines.append(f"  - probe: {confirmed} of {asked} engine answers confirmed at their "
                     f"version against the previous one ({len(probed)} steps)")
    return lines + fp8_lines(steps)


def fp8_lines(steps: list[dict]) -> list[str]:
    """FP8 engines: how far their rollouts were from the trainer's own weights (the check
    above compares them with the trainer's quantized copy), and the TIS weights."""
    means = _numbers(steps, "fp8_logprob_abs_diff_mean")
    if not means:
        return []
    weights = _numbers(steps, "fp8_tis_weight_mean")
    clipped = _numbers(steps, "fp8_tis_clip_frac")
    return [f"- FP8 rollout vs the trainer's unquantized weights: |delta logprob| per token "
            f"mean {statistics.median(means):.3g} (median step), largest "
            f"{max(_numbers(steps, 'fp8_logprob_abs_diff_max')):.3g}; TIS weight "
            f"exp(trainer - rollout) mean {statistics.median(weights):.4g} (median step), "
            f"largest {max(_numbers(steps, 'fp8_tis_weight_max')):.4g}, clipped "
            f"{max(clipped):.3g} of tokens at most ({len(means)} steps)"]


def in_time_order(events: list[dict]) -> list[dict]:
    """Timeline rows by time (stable: rows of one instant keep the order they were logged)."""
    return sorted(events, key=lambda e: float(e.get("time_s", 0.0)))


def notable_events(events: list[dict]) -> list[tuple[dict, str]]:
    """Events that are not routine, with a note; a REGISTERED that ends a recovery counts."""
    log = IncidentLog()
    out = []
    for e in in_time_order(events):
        recovery = log.is_recovery(e)
        outcome = log.feed(e)
        if recovery and outcome is not None:
            out.append((e, f"recovered {outcome[1].recovery_s:.1f} s after the death"))
        elif not is_routine(previous_of(e), kind_of(e["state"], str(e["engine"]))):
            out.append((e, ""))
    return out


def _details(e: dict, note: str) -> str:
    details = {k: v for k, v in e.items() if k not in ("time_s", "engine", "state")}
    text = ", ".join(f"{k}={v}" for k, v in details.items())
    return "; ".join(x for x in (note, text) if x).replace("|", "\\|")


@dataclass
class RunReport:
    """Appends metrics and engine events as they happen; renders plots and markdown at the end."""

    out_dir: Path
    started: float = field(default_factory=time.time)
    endpoints: list[MetricsEndpoint] = field(default_factory=list)

    def __post_init__(self):
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.timeline_path = self.out_dir / "engine_timeline.jsonl"

    def _now(self) -> float:
        return round(time.time() - self.started, 3)

    def begin_run(self) -> Path | None:
        """A new run into this folder: an earlier run's files move to earlier-runs/N/ (their
        clock started at another time); where they went, or None if there were none."""
        found = [self.out_dir / name for name in RUN_FILES if (self.out_dir / name).exists()]
        if not found:
            return None
        earlier = self.out_dir / EARLIER_RUNS
        dest = earlier / str(1 + sum(1 for _ in earlier.iterdir()) if earlier.is_dir() else 1)
        dest.mkdir(parents=True)
        for path in found:
            path.rename(dest / path.name)
        logger.warning("%s held an earlier run's report files; moved them to %s", self.out_dir,
                       dest)
        return dest

    def log_step(self, step: int, metrics: dict[str, Any], *, time_s: float | None = None) -> None:
        """One row of metrics.jsonl; `time_s` (seconds since start) defaults to now."""
        row = {"step": step, "time_s": self._now() if time_s is None else time_s, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def log_event(self, event: FleetEvent, *, time_s: float | None = None) -> None:
        """One row of engine_timeline.jsonl, at the event's own time (seconds since start)."""
        when = round(event.at - self.started, 3) if time_s is None else time_s
        row = {"time_s": when, "engine": event.subject, "state": event.kind.value, **event.row()}
        with self.timeline_path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def save_run_info(self, args: Any) -> None:
        """config.json (resolved flags) and versions.json (with the git revision) beside it."""
        write_run_info(self.out_dir, args)

    def _keep_endpoints(self) -> None:
        """Save the endpoints beside the report, or read them back when re-rendering."""
        path = self.out_dir / "endpoints.json"
        if self.endpoints:
            path.write_text(json.dumps([vars(e) for e in self.endpoints], indent=2) + "\n")
        elif path.is_file():
            self.endpoints = [MetricsEndpoint(**e) for e in json.loads(path.read_text())]

    def _read(self, path: Path) -> list[dict]:
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def render(self, title: str = "slime_like run", notes: list[str] | None = None) -> Path:
        """Plots (PNG) and report.md from what was logged; returns the report path."""
        from slime_like.observe.plots import plot_run

        steps = self._read(self.metrics_path)
        events = in_time_order(self._read(self.timeline_path))
        self._keep_endpoints()
        log = IncidentLog()
        for e in events:
            log.feed(e)
        utilization = read_utilization(self.out_dir / UTILIZATION_FILE)
        figures = plot_run(self.out_dir, steps, events, log.incidents, utilization)

        lines = [f"# {title}", "", "## Summary", ""]
        lines += summary_lines(steps, log.incidents)
        lines += async_metrics.summary_lines(steps, run_idle_ratios(utilization))
        lines += [f"- {note}" for note in notes or []]
        files = [n for n in ("config.json", "versions.json") if (self.out_dir / n).is_file()]
        if files:
            revision, router = "", None
            if "versions.json" in files:
                info = json.loads((self.out_dir / "versions.json").read_text())
                revision, router = info.get("git_revision", ""), info.get("router")
            if router:
                lines.append(f"- router: {router['name']} {router['version']}")
            lines.append(f"- run info: {', '.join(files)}"
                         + (f" (git revision {revision})" if revision else ""))
        if self.endpoints:
            lines += ["", "## Endpoints", "", "Prometheus `/metrics` addresses:", ""]
            lines += [f"- {line}" for line in endpoint_lines(
                [(ep.name, ep.url) for ep in self.endpoints])]
        if figures:
            lines += ["", "## Plots", ""]
            lines += [f"![{label}]({name})" for label, name in figures]
        notable = notable_events(events)
        if events:
            lines += ["", "## Engine events (not routine)", ""]
            routine = len(events) - len(notable)
            lines.append(f"{len(events)} events, {routine} routine ones left out "
                         f"(all in engine_timeline.jsonl).")
        if notable:
            lines += ["", "| t (s) | engine | state | details |", "|---|---|---|---|"]
            for e, note in notable[:MAX_EVENT_ROWS]:
                lines.append(f"| {e['time_s']:.1f} | {e['engine']} | {e['state']} | "
                             f"{_details(e, note)} |")
            if len(notable) > MAX_EVENT_ROWS:
                lines.append(f"\n{len(notable) - MAX_EVENT_ROWS} more in engine_timeline.jsonl.")
        path = self.out_dir / "report.md"
        path.write_text("\n".join(lines) + "\n")
        return path
