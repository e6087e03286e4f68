"""The asynchronous schedules' step metrics in metrics.jsonl, report.md, utilization.png,
Prometheus and TensorBoard; a sync run's report is unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from slime_like.config.slices import TrackingSettings
from slime_like.observe.async_metrics import (
    for_scalar_backends,
    histogram_stats,
    staleness_histogram,
)
from slime_like.observe.report import RunReport
from slime_like.observe.tracking import build_tracker, scalars
from slime_like.observe.utilization import BUSY, DOWN, IDLE, PAUSED, UtilizationLog

ORIGIN = 1_000.0


def _tracking(**kw) -> TrackingSettings:
    base = dict(use_wandb=False, wandb_project="slime_like-test", wandb_group=None,
                wandb_mode="offline", wandb_dir=None, use_tensorboard=False,
                tensorboard_dir=None, job_metrics_port=None)
    return TrackingSettings(**{**base, **kw})


def _step(n: int) -> dict:
    return {"reward_mean": 0.1 * n, "async_mode": "fully-async", "samples_per_s": 8.0,
            "engine_idle_ratio": 0.1, "trainer_idle_ratio": 0.5,
            "staleness": staleness_histogram(n + 2, [n + 2, n + 1, n + 1, n]),
            "samples_partial": 2, "samples_resubmitted": 1, "samples_dropped_stale": n % 2,
            "samples_filtered": 3}


def _async_run(folder) -> RunReport:
    """Four steps of 2 s with two engines, trainer phases and a sync after each step."""
    report = RunReport(folder, started=ORIGIN)
    log = UtilizationLog(folder / "utilization.jsonl", origin=ORIGIN)
    for n in range(4):
        t0 = ORIGIN + 2.0 * n
        for engine in ("e0", "e1"):
            log.write("engine", t0, t0 + 1.8, subject=engine, state=BUSY)
            log.write("engine", t0 + 1.8, t0 + 2.0, subject=engine, state=PAUSED)
        log.write("trainer", t0, t0 + 1.0, subject="trainer", state="train")
        log.write("trainer", t0 + 1.8, t0 + 2.0, subject="trainer", state="sync")
        log.write("sync", t0 + 1.8, t0 + 2.0, version=str(n + 1))
        report.log_step(n, _step(n), time_s=2.0 * (n + 1))
    log.write("engine", ORIGIN + 8.0, ORIGIN + 9.0, subject="e1", state=DOWN)
    log.write("engine", ORIGIN + 8.0, ORIGIN + 9.0, subject="e0", state=IDLE)
    return report


def test_metrics_jsonl_keeps_the_histogram_and_the_report_summarises_the_run(tmp_path):
    report = _async_run(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[3]["staleness"] == {"0": 1, "1": 2, "2": 1}
    text = report.render().read_text()
    summary = text.split("## Plots")[0]
    assert "- schedule: fully-async" in summary
    assert "- samples/s: 8 " in summary
    # Engines: 0.2 s paused in each 2 s step, then e0 1 s idle and e1 1 s down (not observed
    # time): (0.8 + 1.8) / (8 + 9). Trainer: 1.2 s busy per step over the 9 s covered.
    assert "- idle over the run: engines 15.3% (no request running), trainer 46.7%" in summary
    assert ("- staleness (versions behind the trained one): max 2, mean 1 over 16 samples; "
            "by age 0: 4, 1: 8, 2: 4") in summary
    assert ("- samples partial 8, resubmitted 4, dropped as stale 2, filtered 12") in summary
    assert "![engine and trainer busy/idle, syncs marked](utilization.png)" in text
    png = tmp_path / "utilization.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # `slime-like report RUN_DIR` re-renders the same summary and picture from the folder.
    png.unlink()
    subprocess.run([sys.executable, "-m", "slime_like.cli", "report", str(tmp_path)],
                   check=True, capture_output=True)
    assert png.is_file() and summary in (tmp_path / "report.md").read_text()


def test_a_sync_run_without_the_keys_has_no_async_lines(tmp_path):
    report = RunReport(tmp_path)
    for n in range(3):
        report.log_step(n, {"reward_mean": 0.5, "sync_s": 0.1}, time_s=n + 1.0)
    text = report.render().read_text()
    assert "schedule" not in text and "staleness" not in text
    assert not (tmp_path / "utilization.png").exists()


def test_scalar_backends_get_staleness_mean_and_max_instead_of_the_histogram():
    step = _step(2)
    flat = scalars(for_scalar_backends(step))
    assert flat["staleness_max"] == 2.0 and flat["staleness_mean"] == 1.0
    assert flat["staleness_samples"] == 4.0
    assert not any(k.startswith("staleness/") for k in flat) and "async_mode" not in flat
    assert histogram_stats({}) == {} and for_scalar_backends({"x": 1}) == {"x": 1}
    assert staleness_histogram(5, [5, 6, 3]) == {0: 2, 2: 1}  # a newer version is age 0


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_prometheus_serves_ratios_counters_the_staleness_histogram_and_the_mode(tmp_path):
    tracker = build_tracker(_tracking(job_metrics_port=0), tmp_path)
    url = f"http://127.0.0.1:{tracker.backends[0].port}/metrics"
    try:
        tracker.log_step(0, _step(0))
        tracker.log_step(1, _step(1))
        tracker.log_step(2, {"reward_mean": 0.2})  # a step without them is fine
        body = _get(url)
    finally:
        tracker.close()
    assert "slime_like_engine_idle_ratio 0.1" in body
    assert "slime_like_trainer_idle_ratio 0.5" in body
    assert "slime_like_samples_per_second 8.0" in body
    assert "slime_like_samples_partial_total 4.0" in body
    assert "slime_like_samples_resubmitted_total 2.0" in body
    assert "slime_like_samples_dropped_stale_total 1.0" in body
    assert "slime_like_samples_filtered_total 6.0" in body
    # Step 0: ages 0,1,1,2; step 1: the same.
    assert 'slime_like_staleness_bucket{le="0.0"} 2.0' in body
    assert 'slime_like_staleness_bucket{le="1.0"} 6.0' in body
    assert 'slime_like_staleness_bucket{le="+Inf"} 8.0' in body
    assert "slime_like_staleness_count 8.0" in body and "slime_like_staleness_sum 8.0" in body
    assert "slime_like_staleness_max 2.0" in body
    assert 'slime_like_async_mode{mode="fully-async"} 1.0' in body
    assert 'slime_like_async_mode{mode="sync"} 0.0' in body


def test_tensorboard_gets_the_staleness_histogram_and_its_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = build_tracker(_tracking(use_tensorboard=True), tmp_path)
    for n in range(2):
        tracker.log_step(n, _step(n))
    tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("staleness_max")] == [2.0, 2.0]
    (first, _) = acc.Histograms("staleness")
    assert first.histogram_value.num == 4 and first.histogram_value.max == 2.0


def test_a_sync_schedule_with_the_sampler_on_shows_its_idle_ratios_for_comparison(tmp_path):
    report = RunReport(tmp_path, started=ORIGIN)
    log = UtilizationLog(tmp_path / "utilization.jsonl", origin=ORIGIN)
    log.write("engine", ORIGIN, ORIGIN + 1.0, subject="e0", state=BUSY)
    log.write("engine", ORIGIN + 1.0, ORIGIN + 4.0, subject="e0", state=IDLE)
    log.write("trainer", ORIGIN + 1.0, ORIGIN + 4.0, subject="trainer", state="train")
    report.log_step(0, {"reward_mean": 0.5, "async_mode": "sync", "samples_per_s": 2.0,
                        "engine_idle_ratio": 0.75, "trainer_idle_ratio": 0.25}, time_s=4.0)
    text = report.render().read_text()
    assert "- schedule: sync" in text
    assert "- idle over the run: engines 75.0% (no request running), trainer 25.0%" in text
    assert "staleness" not in text and "samples partial" not in text
