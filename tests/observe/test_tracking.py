"""Tracking backends write real files and serve real HTTP; none enabled means no-op."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import pytest

from slime_like.config.parse import parse_args
from slime_like.config.slices import TrackingSettings
from slime_like.errors import ConfigError
from slime_like.fleet.events import FleetEvent, kind_of
from slime_like.observe.tracking import (
    TensorBoardBackend,
    Tracker,
    TrackingError,
    WandbBackend,
    build_tracker,
    scalars,
)


def _args(**kw) -> TrackingSettings:
    base = dict(use_wandb=False, wandb_project="slime_like-test", wandb_group=None,
                wandb_mode="offline", wandb_dir=None, use_tensorboard=False,
                tensorboard_dir=None, job_metrics_port=None)
    return TrackingSettings(**{**base, **kw})


def _event(subject: str, state: str, **details) -> FleetEvent:
    return FleetEvent(subject, kind_of(state, subject), details=details)


def test_no_backend_enabled_is_a_no_op(tmp_path):
    tracker = build_tracker(_args(), tmp_path)
    assert not tracker.enabled and tracker.metrics_url is None
    tracker.log_step(0, {"reward_mean": 1.0})
    tracker.log_event(_event("e0", "DEAD"))
    tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_scalars_keep_finite_numbers_and_flatten_dicts():
    got = scalars({"reward_mean": 0.5, "ok": True, "engines": {"e0": "REGISTERED"},
                   "diff": float("nan"), "train": {"loss": 2, "name": "x"}, "n": 3})
    assert got == {"reward_mean": 0.5, "train/loss": 2.0, "n": 3.0}


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = build_tracker(_args(use_tensorboard=True), tmp_path)
    for step in range(3):
        tracker.log_step(step, {"reward_mean": 0.25 * step, "sync_s": 0.1, "engines": {}})
    tracker.log_event(_event("default/g0/e0", "DEAD", reason="exit -9"))
    tracker.close()

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"reward_mean", "sync_s"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(0, 0.0), (1, 0.25),
                                                                       (2, 0.5)]


def test_wandb_offline_writes_a_run_directory_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = build_tracker(_args(use_wandb=True, wandb_dir=str(tmp_path / "wb")), tmp_path,
                            config={"lr": 1e-6})
    assert [b.name for b in tracker.backends] == ["wandb"]
    tracker.log_step(0, {"reward_mean": 0.5})
    tracker.log_event(_event("e0", "DEAD", reason="exit -9"))
    tracker.log_event(_event("e0", "REGISTERED", version="2"))
    run = tracker.backends[0].run
    assert run.summary["engine_events/DEAD"] == 1
    assert run.summary["engine_recovery_s/e0"] >= 0
    tracker.log_step(1, {"reward_mean": 0.75})
    tracker.close()
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wb").rglob("*"))
    assert list(runs[0].glob("run-*.wandb"))


def test_missing_wandb_is_a_one_line_error_saying_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(TrackingError) as err:
        WandbBackend(project="p", group=None, mode="offline", dir=tmp_path)
    assert str(err.value) == "--use-wandb: the wandb package is not installed: pip install wandb"
    assert isinstance(err.value, ConfigError)


def test_missing_tensorboard_is_a_one_line_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(TrackingError, match=r"^--use-tensorboard: .*pip install tensorboard$"):
        TensorBoardBackend(tmp_path)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_job_metrics_endpoint_serves_steps_engine_states_and_recoveries(tmp_path):
    tracker = build_tracker(_args(job_metrics_port=0), tmp_path)
    port = tracker.backends[0].port
    assert tracker.metrics_url.endswith(f":{port}/metrics")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for engine in ("e0", "e1"):
            tracker.log_event(_event(engine, "LOADED", url="http://127.0.0.3:30001"))
            tracker.log_event(_event(engine, "REGISTERED", version="1"))
        tracker.log_step(3, {"reward_mean": 0.5, "sync_s": 0.25, "sync_gbps": 2.0})
        tracker.log_event(_event("e0", "DEAD", reason="exit -9"))
        tracker.log_event(_event("e0", "RELAUNCHING"))
        tracker.log_event(_event("e0", "STALE"))
        mid = _get(url)
        tracker.log_event(_event("e0", "REGISTERED", version="5"))
        body = _get(url)
    finally:
        tracker.close()
    # the node from the engine's URL, kept for the states after it
    assert 'slime_like_engine_state{engine="e0",node="127.0.0.3",state="STALE"} 1.0' in mid
    assert 'slime_like_engine_recoveries_total{engine="e0"}' not in mid
    assert "slime_like_step 3.0" in body
    assert "slime_like_reward_mean 0.5" in body
    assert "slime_like_sync_seconds 0.25" in body and "slime_like_sync_gbps 2.0" in body
    assert 'slime_like_engine_state{engine="e0",node="127.0.0.3",state="REGISTERED"} 1.0' in body
    assert 'slime_like_engine_state{engine="e0",node="127.0.0.3",state="STALE"} 0.0' in body
    assert 'slime_like_engine_deaths_total{engine="e0"} 1.0' in body
    assert 'slime_like_engine_recoveries_total{engine="e0"} 1.0' in body
    assert 'slime_like_engine_deaths_total{engine="e1"}' not in body
    with pytest.raises(urllib.error.URLError):
        _get(url)  # closed with the tracker


def test_a_failing_backend_is_dropped_and_the_others_keep_logging():
    class Broken:
        name = "broken"

        def log_step(self, step, values):
            raise RuntimeError("disk full")

        def log_event(self, event): ...

        def close(self): ...

    class Keeps:
        name = "keeps"

        def __init__(self):
            self.steps = []

        def log_step(self, step, values):
            self.steps.append(step)

        def log_event(self, event): ...

        def close(self): ...

    keeps = Keeps()
    tracker = Tracker([Broken(), keeps])
    tracker.log_step(0, {"x": 1})
    tracker.log_step(1, {"x": 1})
    assert [b.name for b in tracker.backends] == ["keeps"] and keeps.steps == [0, 1]


def test_tracking_flags_parse_with_slimes_names():
    args = parse_args(["--config", "configs/quickstart.yaml", "--use-wandb", "--wandb-mode",
                       "offline", "--wandb-group", "g", "--use-tensorboard",
                       "--job-metrics-port", "0"])
    assert (args.use_wandb, args.wandb_mode, args.wandb_group) == (True, "offline", "g")
    assert args.use_tensorboard and args.job_metrics_port == 0
    with pytest.raises(ConfigError, match="^--wandb-mode: invalid choice"):
        parse_args(["--config", "configs/quickstart.yaml", "--wandb-mode", "cloud"])


def test_a_job_asking_for_a_missing_package_stops_with_one_line_before_starting(
        tmp_path, monkeypatch, capsys):
    import importlib.util

    from slime_like.train import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    code = main(["--config", "configs/quickstart.yaml", "--use-tensorboard",
                 "--output-dir", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err == ("slime-like train: error: --use-tensorboard: the "
                                       "tensorboard package is not installed: pip install "
                                       "tensorboard\n")
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_a_taken_metrics_port_is_named_in_the_error(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TrackingError, match=rf"^--job-metrics-port: cannot serve on "
                                                rf"0\.0\.0\.0:{port}: "):
            build_tracker(_args(job_metrics_port=port), tmp_path)
