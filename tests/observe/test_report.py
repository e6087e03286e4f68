"""report.md reads summary-first and stays short; run info is saved beside it."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from slime_like.fleet.events import FleetEvent, Happening, kind_of  # noqa: E402
from slime_like.observe.endpoints import metrics_endpoints  # noqa: E402
from slime_like.observe.fleet_view import endpoint_lines, states_summary  # noqa: E402
from slime_like.observe.incidents import incidents_of  # noqa: E402
from slime_like.observe.plots import _mark_incidents  # noqa: E402
from slime_like.observe.report import RunReport, phase_line, sync_metrics  # noqa: E402
from slime_like.observe.run_info import git_revision, json_safe  # noqa: E402

E0, E1 = "default/g0/e0", "default/g0/e1"
STEPS, DEATH_STEP = 150, 10


class Events:
    """Logs fleet events into a report as the fleet emits them: each state change carries
    the state its subject left."""

    def __init__(self, report: RunReport):
        self.report = report
        self.last: dict = {}

    def __call__(self, subject: str, state: str, *, time_s: float, **details) -> None:
        kind = kind_of(state, subject)
        previous = None
        if not isinstance(kind, Happening):
            previous, self.last[subject] = self.last.get(subject), kind
        self.report.log_event(FleetEvent(subject, kind, previous, details), time_s=time_s)


def _quickstart_like_run(report: RunReport) -> None:
    """What the quickstart logs: two engines, a sync per step, e0 killed during step 10."""
    t = 0.0
    log = Events(report)

    def event(engine: str, state: str, **details) -> None:
        log(engine, state, time_s=round(t, 3), **details)

    event("router", "READY", url="http://127.0.0.1:30000", pid=100)
    for e in (E0, E1):
        event(e, "LAUNCHING")
    t = 8.0
    for n, e in enumerate((E0, E1)):
        event(e, "LOADED", url=f"http://127.0.0.1:3100{n}", version="0", pid=200 + n)
    recovering = False
    for step in range(-1, STEPS):  # -1: the first sync before step 0
        t += 1.5
        if step == DEATH_STEP:
            event(E0, "DEAD", reason="server process exited (-9)")
            recovering = True
            t += 0.5
            event(E0, "RELAUNCHING")
        if step == DEATH_STEP + 3:
            event(E0, "STALE", url="http://127.0.0.1:31002", version=str(step), pid=300)
        live = [E1] if recovering else [E0, E1]
        for e in live:
            event(e, "UPDATING")
        t += 0.2
        for e in live:
            event(e, "REGISTERED", version=str(step + 2))
        if step == DEATH_STEP + 3:
            event(E0, "REGISTERED", version=str(step + 2))
            recovering = False
        if step >= 0:
            report.log_step(step, {"reward_mean": min(1.0, 0.1 + step / 160), "sync_s": 0.2,
                                   "sync_gbps": 1.25, "logprob_max_abs_diff": 2e-6,
                                   "engines": {E0: "REGISTERED", E1: "REGISTERED"}},
                            time_s=round(t, 3))


def test_quickstart_report_is_short_summary_first_and_without_routine_rows(tmp_path):
    report = RunReport(tmp_path)
    _quickstart_like_run(report)
    report.endpoints = metrics_endpoints({E0: "http://127.0.0.1:31002", E1: "http://127.0.0.1:31001"},
                                         {"default": "http://127.0.0.1:29000/metrics"})
    events = [json.loads(x) for x in (tmp_path / "engine_timeline.jsonl").read_text().splitlines()]
    assert len(events) > 500  # hundreds of routine events went in

    text = report.render().read_text()
    lines = text.splitlines()
    assert len(lines) < 80, text

    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert "- steps: 150 (0..149)" in summary
    assert "- reward: 0.1 (step 0) → 1 (step 149)" in summary
    assert "median 0.2 s, median 1.25 GB/s" in summary
    assert "- engine deaths: 1" in summary
    death = next(x for x in summary.splitlines() if E0 in x)
    # seen dead at t=28.2 (during step 10), served again at t=34.0 (step 13's sync)
    assert "seen dead at step 10" in death and "server process exited" in death
    assert "recovered in 5.8 s (serving version 15)" in death

    table = [x for x in lines if x.startswith("| ") and not x.startswith("| t (s)")]
    states = [row.split("|")[3].strip() for row in table]
    assert states == ["READY", "DEAD", "RELAUNCHING", "STALE", "REGISTERED"]
    assert "recovered 5.8 s after the death" in table[-1]
    assert not any(s in ("UPDATING", "LOADED", "LAUNCHING") for s in states)
    assert "## Endpoints" in text and f"engine {E0}: http://127.0.0.1:31002/metrics" in text
    assert "router default: http://127.0.0.1:29000/metrics" in text
    for png in ("reward.png", "weight_sync.png", "engine_timeline.png"):
        assert (tmp_path / png).stat().st_size > 0
        assert f"]({png})" in text


def test_reward_plot_marks_death_and_recovery_at_their_steps(tmp_path):
    report = RunReport(tmp_path)
    _quickstart_like_run(report)
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (tmp_path / "engine_timeline.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots()
    _mark_incidents(ax, steps, incidents_of(events))
    xs = sorted(float(line.get_xdata()[0]) for line in ax.lines)
    plt.close(fig)
    assert len(xs) == 2
    death, recovery = xs
    assert DEATH_STEP - 1 < death <= DEATH_STEP  # during step 10
    assert DEATH_STEP + 2 < recovery <= DEATH_STEP + 3  # registered in step 13's sync


def test_a_failed_recovery_is_reported_as_not_recovered(tmp_path):
    report = RunReport(tmp_path)
    report.log_step(0, {"reward_mean": 0.5}, time_s=1.0)
    log = Events(report)
    log(E0, "DEAD", time_s=0.5, reason="3 failed probes")
    log(E0, "RELAUNCHING", time_s=0.6)
    log(E0, "DEAD", time_s=0.9, reason="recovery failed: no bundle")
    text = report.render().read_text()
    assert "- engine deaths: 1" in text
    assert "NOT recovered (recovery failed: no bundle)" in text


def test_a_relaunched_router_counts_as_recovered(tmp_path):
    report = RunReport(tmp_path)
    report.log_step(0, {"reward_mean": 0.5}, time_s=1.0)
    log = Events(report)
    log("router/default", "READY", time_s=0.1, url="http://127.0.0.1:30000")
    log("router/default", "DEAD", time_s=2.0, code=-9)
    log("router/default", "READY", time_s=3.5, url="http://127.0.0.1:30000", restart_s=1.5,
        workers=2)
    text = report.render().read_text()
    assert "- router/default seen dead" in text and "recovered in 1.5 s" in text
    assert "NOT recovered" not in text


def test_sync_metrics_derive_gbps_from_the_bytes_moved():
    assert sync_metrics({"total_s": 0.5, "transfer": {"bytes": 2_000_000_000}}) == {
        "sync_s": 0.5, "sync_gbps": 4.0, "sync_gb": 2.0}
    assert sync_metrics({"total_s": 0.5, "transfer": {}}) == {"sync_s": 0.5}
    # the update requests per engine and the trainer's pack copy (0: sent in place)
    assert sync_metrics({"total_s": 0.01, "transfer": {"bytes": 10**9, "buckets": 1,
                                                       "pack_s": 0.0}}) == {
        "sync_s": 0.01, "sync_gbps": 100.0, "sync_gb": 1.0, "sync_requests": 1,
        "sync_pack_s": 0.0}
    # and where the time went, in ms
    detail = sync_metrics({"total_s": 0.01, "seconds": {"begin": 0.001, "transfer": 0.006},
                           "round_trips": {"update_mean": 0.004},
                           "transfer": {"prep_s": 0.0005, "wait_s": 0.005}})["sync_detail_ms"]
    assert detail == {"step_begin": 1.0, "step_transfer": 6.0, "rt_update_mean": 4.0,
                      "prep": 0.5, "wait": 5.0}
    assert sync_metrics({}) == {}


def test_the_summary_splits_a_colocated_step_into_its_phases_with_their_rates():
    steps = [{"step": i, "trainer_offload_s": 0.2 + i, "trainer_offload_gbps": 45.0,
              "rollout_s": 0.3, "engine_release_s": 0.05, "train_s": 0.1,
              "engine_resume_s": 0.06, "sync_s": 0.02, "sync_gbps": 150.0, "step_s": 1.0}
             for i in range(3)]
    line = phase_line(steps)
    assert line.startswith("- step phases (median): trainer offload 1.2 s (45 GB/s), "
                           "generation 0.3 s")
    assert "engine release 0.05 s, training 0.1 s, engine resume 0.06 s" in line
    assert line.endswith("sync 0.02 s (150 GB/s), whole step 1 s")
    assert phase_line([{"step": 0, "sync_s": 0.1}]) is None  # nothing to split


def test_run_info_saves_resolved_flags_versions_and_git_revision(tmp_path):
    class Plan:
        def __repr__(self) -> str:
            return "Plan(2 engines)"

    args = argparse.Namespace(output_dir=Path("/runs/x"), lr=1e-6, plan=Plan(),
                              sglang_flags={"tp_size": 2}, choices={"b", "a"})
    report = RunReport(tmp_path / "run")
    report.save_run_info(args)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config == {"output_dir": "/runs/x", "lr": 1e-6, "plan": "Plan(2 engines)",
                      "sglang_flags": {"tp_size": 2}, "choices": ["a", "b"]}
    versions = json.loads((tmp_path / "run" / "versions.json").read_text())
    assert {"python", "torch", "ray", "sglang-router", "smg", "slime_like"} <= set(versions)
    # the router the run starts, read from its own distribution (default: sglang-router)
    assert versions["router"] == {"name": "sglang-router", "version": versions["sglang-router"]}
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", versions["git_revision"])
    assert git_revision(tmp_path) == "unknown"  # not a git checkout
    other = tmp_path / "other-project"
    (other / "venv" / "slime_like").mkdir(parents=True)
    (other / "pyproject.toml").write_text("[project]\nname = 'other'\n")
    git = ["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(git + ["add", "pyproject.toml"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    assert git_revision(other / "venv" / "slime_like") == "unknown"  # someone else's repo
    report.log_step(0, {"reward_mean": 0.5})
    assert "- run info: config.json, versions.json (git revision " in report.render().read_text()
    report.save_run_info(argparse.Namespace(router="smg"))
    versions = json.loads((tmp_path / "run" / "versions.json").read_text())
    assert versions["router"] == {"name": "smg", "version": "1.13.0"}
    assert "- router: smg 1.13.0" in report.render().read_text()


def test_json_safe_keeps_plain_values_and_names_the_rest():
    assert json_safe({"a": (1, 2.5, None, True)}) == {"a": [1, 2.5, None, True]}


def test_the_event_table_is_in_time_order_and_one_runs_own(tmp_path):
    """A second run into the same folder (the first failed while launching) reports only
    itself: the earlier run's files move to earlier-runs/1, so its clock does not interleave
    (a reused folder listed 14.8 s before 14.3 s); rows logged out of order come out sorted."""
    first = RunReport(tmp_path)
    log = Events(first)
    log(E0, "LAUNCHING", time_s=0.1)
    log(E0, "STOPPED", time_s=14.8, reason="the job failed (LaunchError: x) while it was "
                                            "launching: it never served")
    first.render()
    second = RunReport(tmp_path)
    moved = second.begin_run()
    assert moved == tmp_path / "earlier-runs" / "1"
    assert (moved / "engine_timeline.jsonl").is_file() and (moved / "report.md").is_file()
    assert not (tmp_path / "engine_timeline.jsonl").exists()
    log = Events(second)
    log(E0, "LAUNCHING", time_s=0.1)
    log(E0, "LOADED", time_s=9.0, url="http://127.0.0.1:31000")
    log(E0, "UPDATING", time_s=9.5)
    log(E0, "REGISTERED", time_s=9.6, version="1")
    log(E0, "DEAD", time_s=14.8, reason="server process exited with code -9")
    log(E0, "RELAUNCHING", time_s=14.3)  # logged after, stamped before (another thread)
    text = second.render().read_text()
    rows = [x for x in text.splitlines() if x.startswith("| ") and not x.startswith("| t (s)")]
    times = [float(r.split("|")[1]) for r in rows]
    assert times == sorted(times) and len(rows) == 2, rows
    assert "STOPPED" not in text and "LaunchError" not in text
    assert RunReport(tmp_path).begin_run() == tmp_path / "earlier-runs" / "2"


def test_a_colocated_release_and_resume_are_routine(tmp_path):
    report = RunReport(tmp_path)
    log = Events(report)
    for t, state in enumerate(["LAUNCHING", "LOADED", "UPDATING", "REGISTERED", "OFFLOADED",
                               "REGISTERED", "UPDATING", "REGISTERED", "OFFLOADED", "STALE",
                               "UPDATING", "REGISTERED"]):
        log(E0, state, time_s=float(t))
    text = report.render().read_text()
    assert "12 events, 12 routine ones left out" in text
    assert "| OFFLOADED |" not in text


def test_a_64_engine_run_reads_as_well_as_a_2_engine_one(tmp_path):
    """The fleet's version each sync is routine; the timeline draws engines per state, not
    a row per engine (64 rows would not fit a page)."""
    report = RunReport(tmp_path)
    log = Events(report)
    engines = [f"default/g{i // 8}/e{i % 8}" for i in range(64)]
    t = 0.0
    for e in engines:
        log(e, "LAUNCHING", time_s=t)
    t = 10.0
    for e in engines:
        log(e, "LOADED", time_s=t)
    for step in range(20):
        t += 1.0
        for e in engines:
            log(e, "UPDATING", time_s=t)
        t += 0.1
        for e in engines:
            log(e, "REGISTERED", time_s=t, version=str(step + 1))
        log("fleet", "VERSION", time_s=t, version=str(step + 1))
        if step == 5:
            log(engines[9], "DEAD", time_s=t + 0.2, reason="server process exited (-9)")
            log(engines[9], "RELAUNCHING", time_s=t + 0.3)
        if step == 8:
            log(engines[9], "STALE", time_s=t + 0.2)
        report.log_step(step, {"reward_mean": 0.5, "sync_s": 0.2}, time_s=t)

    text = report.render().read_text()
    table = [x for x in text.splitlines() if x.startswith("| ") and not x.startswith("| t (s)")]
    assert not any("VERSION" in row for row in table), table
    assert any("DEAD" in row for row in table)
    height = plt.imread(tmp_path / "engine_timeline.png").shape[0]
    assert height < 600, height  # a row per engine would be 64 * 55 px


def test_a_64_engine_fleet_is_grouped_in_the_step_line_and_the_endpoints():
    """The step's log line names the engines that are not serving, not all 64; the report's
    endpoints list the routers and one line per host of engines."""
    states = {f"default/g0/e{i}": "REGISTERED" for i in range(64)}
    states["default/g0/e9"] = "RELAUNCHING"
    assert states_summary(states) == ("64 engines: 63 REGISTERED, 1 RELAUNCHING "
                                      "(default/g0/e9)")
    two = {"default/g0/e0": "REGISTERED", "default/g0/e1": "DEAD"}
    assert states_summary(two) == str(two)  # a small fleet: each engine, as before
    urls = [("router default", "http://198.18.0.100:3000/metrics")] + [
        (f"engine default/g0/e{i}", f"http://198.18.0.{1 + i // 8}:{30000 + i}/metrics")
        for i in range(64)]
    lines = endpoint_lines(urls)
    assert lines[0] == "router default: http://198.18.0.100:3000/metrics"
    assert lines[1:] == [f"engines on 198.18.0.{n}: 8 (each address in endpoints.json)"
                         for n in range(1, 9)]
    assert endpoint_lines(urls[:3]) == [f"{n}: {u}" for n, u in urls[:3]]
