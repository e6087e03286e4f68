"""The run's observers: one event or step reaches the report, the tracker and the console."""

from __future__ import annotations

import json
import urllib.request

from slime_like.config.parse import parse_args
from slime_like.config.slices import observe_settings
from slime_like.fleet.events import EngineState, FleetEvent, RouterState
from slime_like.observe import RunObservers


def test_events_and_steps_reach_report_tracking_and_console(tmp_path, capsys):
    args = parse_args(["--config", "configs/quickstart.yaml", "--num-rollout", "2",
                       "--job-metrics-port", "0", "--output-dir", str(tmp_path)])
    obs = RunObservers.start(observe_settings(args), tmp_path)
    try:
        job_url = obs.tracker.metrics_url
        assert job_url and job_url.endswith("/metrics")
        obs.on_event(FleetEvent("router", RouterState.READY,
                                details={"url": "http://127.0.0.1:30000", "pid": 1}))
        obs.add_router("default", "http://127.0.0.1:29000/metrics")
        for n in range(2):
            obs.on_event(FleetEvent(f"default/g0/e{n}", EngineState.LAUNCHING))
            obs.on_event(FleetEvent(f"default/g0/e{n}", EngineState.LOADED, EngineState.LAUNCHING,
                                    {"url": f"http://127.0.0.1:3100{n}", "version": "0",
                                     "pid": 10 + n}))
        obs.log_step(0, {"reward_mean": 0.25, "sync_s": 0.1})
        obs.log_step(1, {"reward_mean": 0.5, "sync_s": 0.1})
        port = obs.tracker.backends[0].port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert "slime_like_reward_mean 0.5" in r.read().decode()
    finally:
        text = obs.close("test run").read_text()

    out = capsys.readouterr().out
    assert f"[slime_like] job metrics: {job_url}" in out
    assert "[slime_like] engine default/g0/e1 ready (2/2): http://127.0.0.1:31001/metrics" in out
    assert "[slime_like] step 2/2, reward 0.500" in out
    assert [ep.line() for ep in obs.endpoints] == [
        f"job: {job_url}", "router default: http://127.0.0.1:29000/metrics",
        "engine default/g0/e0: http://127.0.0.1:31000/metrics",
        "engine default/g0/e1: http://127.0.0.1:31001/metrics"]
    assert "## Endpoints" in text and "engine default/g0/e0: http://127.0.0.1:31000/metrics" in text
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_rollout"] == 2 and config["job_metrics_port"] == 0
    assert (tmp_path / "versions.json").is_file()
