"""Recovery, phase by phase, next to a cold start — measured on real engines in one run.

    python benchmarks/recovery.py                 # 2 reference engines on CPU, 3 kills, 1 hang
    python benchmarks/recovery.py --kills 5 --json out.jsonl

A kill (SIGKILL of a serving engine's server) goes: detected (DEAD) -> relaunched (STALE:
healthy, old weights) -> synced and routed (REGISTERED at the fleet's version). A hang
(SIGSTOP) goes: out of the router (SUSPECT, at the first failed probe) -> DEAD after N
failed probes -> the same. The cold start is the fleet's own launch (LAUNCHING -> LOADED)
plus the first sync (-> REGISTERED), for the same engines on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch

from slime_like.api import FleetEvent, FleetWeights, HealthSettings, launch_fleet
from slime_like.chaos import kill_engine, stop_engine
from slime_like.models import load_pretrained
from slime_like.models.tiny import make_tiny_model

HERE = Path(__file__).resolve().parent
YAML = HERE.parent / "examples" / "own_trainer" / "fleet.yaml"


class Timeline:
    """Every lifecycle event with the time it was seen."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, event: FleetEvent) -> None:
        with self.lock:
            self.events.append((time.time(), event.subject, event.kind.value))

    def first(self, engine: str, state: str, after: float) -> float:
        with self.lock:
            for t, e, s in self.events:
                if e == engine and s == state and t >= after:
                    return t
        raise LookupError(f"{engine} never reached {state} after {after}")

    def wait(self, engine: str, state: str, after: float, timeout: float = 300.0) -> float:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                return self.first(engine, state, after)
            except LookupError:
                time.sleep(0.02)
        raise TimeoutError(f"{engine} did not reach {state} within {timeout}s")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--hangs", type=int, default=1)
    p.add_argument("--probe-interval", type=float, default=0.5)
    p.add_argument("--probe-timeout", type=float, default=2.0)
    p.add_argument("--failures", type=int, default=2)
    p.add_argument("--json", default=None, help="append the rows as JSON lines here")
    a = p.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    model_path = make_tiny_model(out / "model", seed=0)
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    timeline = Timeline()
    t0 = time.time()
    fleet = launch_fleet(YAML, model_path=model_path, engine="reference", log_dir=out / "logs",
                         on_event=timeline,
                         health=HealthSettings(enabled=True, interval_s=a.probe_interval,
                                               timeout_s=a.probe_timeout, first_wait_s=0.0,
                                               failure_threshold=a.failures))
    rows: list[dict] = []
    try:
        model = load_pretrained(model_path, dtype=torch.float32)
        weights = FleetWeights(fleet, transport="distributed", update_weight_buffer_size=1 << 20)
        weights.push(model)
        engines = [e.engine_id for e in fleet.engines]
        for e in engines:
            launched = timeline.first(e, "LAUNCHING", t0)
            rows.append({"kind": "cold_start", "engine": e,
                         "launch_s": timeline.first(e, "LOADED", t0) - launched,
                         "total_s": timeline.first(e, "REGISTERED", t0) - launched})
        for i in range(a.kills + a.hangs):
            hang = i >= a.kills
            index = i % len(engines)
            engine = engines[index]
            time.sleep(1.0)
            start = time.time()
            (stop_engine if hang else kill_engine)(fleet, index)
            row = {"kind": "hang" if hang else "kill", "engine": engine}
            if hang:
                row["unrouted_s"] = timeline.wait(engine, "SUSPECT", start) - start
            dead = timeline.wait(engine, "DEAD", start)
            relaunched = timeline.wait(engine, "STALE", dead)
            routed = timeline.wait(engine, "REGISTERED", relaunched)
            row.update(detect_s=dead - start, relaunch_s=relaunched - dead,
                       sync_route_s=routed - relaunched, total_s=routed - start)
            rows.append(row)
        weights.close()
    finally:
        fleet.shutdown()
        ray.shutdown()
    cold = statistics.mean(r["total_s"] for r in rows if r["kind"] == "cold_start")
    print(f"{'kind':10} {'engine':16} {'unrouted':>9} {'detect':>8} {'relaunch':>9} "
          f"{'sync+route':>11} {'total':>8} {'vs cold':>8}")
    for r in rows:
        if r["kind"] == "cold_start":
            print(f"{'cold':10} {r['engine']:16} {'':>9} {'':>8} {r['launch_s']:9.2f} "
                  f"{r['total_s'] - r['launch_s']:11.2f} {r['total_s']:8.2f} {'1.00x':>8}")
            continue
        r["vs_cold_start"] = r["total_s"] / cold
        unrouted = f"{r['unrouted_s']:9.2f}" if "unrouted_s" in r else f"{'':>9}"
        print(f"{r['kind']:10} {r['engine']:16} {unrouted} {r['detect_s']:8.2f} "
              f"{r['relaunch_s']:9.2f} {r['sync_route_s']:11.2f} {r['total_s']:8.2f} "
              f"{r['vs_cold_start']:7.2f}x")
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main()
