"""What every topology test asserts about a finished run of the real job."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from slime_like.config.parse import parse_args
from slime_like.train import train


def run_job(run_dir: Path, config: str, *flags: str) -> list[dict]:
    """Run `python -m slime_like.train --config config ...` in-process; its metrics."""
    args = parse_args(["--config", config, "--output-dir", str(run_dir), *flags])
    assert train(args) == 0
    return metrics(run_dir)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def timeline(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "engine_timeline.jsonl").read_text().splitlines()]


def states_of(events: list[dict], engine: str) -> list[str]:
    return [e["state"] for e in events if e["engine"] == engine]


def check_run(run_dir: Path, steps: int, updatable: list[str]) -> list[dict]:
    """Generation worked at every step, the log-probability check held at every step (each
    sample's mean difference within the default tolerance), and every engine of the
    updatable model ended routed at the final version."""
    ms = metrics(run_dir)
    assert [m["step"] for m in ms] == list(range(steps))
    for m in ms:
        assert m["samples_returned"] == m["samples_requested"] > 0, m
        assert m["logprob_sample_mean_diff_max"] < 1e-4, m
    final = ms[-1]["weight_version"]
    events = timeline(run_dir)
    versions = [e for e in events if e["engine"] == "fleet" and e["state"] == "VERSION"]
    assert int(versions[-1]["version"]) == final
    for engine in updatable:
        mine = [e for e in events if e["engine"] == engine and e["state"] != "STOPPED"]
        assert mine, f"no events of {engine}"
        routed = [e for e in mine if e["state"] in ("REGISTERED", "UPDATING", "STALE",
                                                     "OFFLOADED")]
        assert routed[-1]["state"] in ("REGISTERED", "OFFLOADED") or \
            routed[-1].get("reason") == "memory resumed", (engine, mine[-3:])
        synced = [e for e in mine if e["state"] == "REGISTERED" and "version" in e]
        assert int(synced[-1]["version"]) == final, (engine, synced[-1])
    return ms


def no_process_outlives(run_dir: Path, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
            except psutil.Error:
                continue
            if str(run_dir) in cmd and "pytest" not in cmd:
                alive.append(cmd)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert alive == [], "processes of the run outlived it"
