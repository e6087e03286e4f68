"""Asynchronous RL side by side: one config, run as sync, one-step and fully-async (each
pause mode), in one process, on one local Ray cluster.

    python benchmarks/async_rl.py                      # configs/async_cpu.yaml, 40 steps
    python benchmarks/async_rl.py --steps 20 --modes sync,fully-async:retract
    # dispatch side by side, 4 engines: each mode once per router:policy (admission: the
    # rollout client binds each request to a free engine slot, --rollout-dispatch admission)
    python benchmarks/async_rl.py --engines 4 --modes fully-async:retract \
        --dispatch sglang-router:round_robin,sglang-router:cache_aware,sglang-router:admission
    # admission:K: at most K requests queued in an engine beyond its slots
    # (--rollout-dispatch-queue K; plain admission: the default, 0)
    python benchmarks/async_rl.py --engines 4 --modes fully-async:retract \
        --dispatch sglang-router:admission,sglang-router:admission:2

Each run is the real job (reference engines behind the router, the trainer over gloo); job
flags the benchmark does not know (`--router smg --router-policy least_load`, ...) go to
every run.
Figures are taken over the steady part of each run (from the end of its first step to the
end of its last), so engine start-up and the first sync do not count:

- samples/s: trained samples / that window, and its ratio to the sync run's;
- step time, and for the sync run max(rollout, train + sync), the bound an overlapped
  schedule can reach (the fully-async target is <= 1.15x of it); each run's own median
  train + sync (score, check, train and sync: longer where generation shares the cores);
- engine idle: share of engine time with no request running (sampled from /v1/loads every
  50 ms), and the same without the syncs' own pauses (paused time left out of both the
  idle time and the engine time), split by cause (observe/idle_causes.py: each idle poll
  blamed on what the engine and the rollout client held then): `dispatch` (requests
  existed but were elsewhere: on their way between client and engine, queued on another
  engine, waiting in the client for a slot: what a dispatch policy can still win), `sync
  edges` (retracted requests not yet re-admitted, the first poll after a resume), and
  `schedule` (the client had nothing to send: the producer at its staleness window waiting
  for the trainer, or between groups; no dispatch can fill that);
- slots filled: the mean share of the engines' `max_running_requests` running a request
  over the same time (idle counts 0): a slot freed and left empty for a round trip lowers
  it while the engine still counts as busy;
- trainer idle: share of the window outside score/check/train/sync, trainer
  alone: share of the window when the trainer works and no engine has a request running
  (on shared cores, one core then has nothing to run);
- staleness: versions between a sample's oldest token and the trained version;
- reward first -> last, and the largest per-token |engine - trainer| log-probability
  difference, each token checked at its own span's version;
- CPU busy: the machine's CPU time used over the same window (psutil, sampled every
  50 ms while the run's metrics.jsonl grows): on a 2-core box the trainer and the engines
  share the cores, which bounds what overlap can win.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slime_like.config.parse import parse_args  # noqa: E402
from slime_like.observe.idle_causes import CAUSES, DISPATCH, SCHEDULE, SYNC_EDGES  # noqa: E402
from slime_like.observe.utilization import read_utilization  # noqa: E402
from slime_like.protocol.modes import Dispatch  # noqa: E402
from slime_like.train import train  # noqa: E402

ADMISSION = Dispatch.ADMISSION  # the POLICY word of --dispatch for the client's admission
MODES = {
    "sync": ["--async-mode", "sync"],
    "one-step": ["--async-mode", "one-step"],
    "fully-async:retract": ["--async-mode", "fully-async", "--pause-generation-mode", "retract"],
    "fully-async:in_place": ["--async-mode", "fully-async", "--pause-generation-mode",
                             "in_place", "--sglang-disable-radix-cache"],
    "fully-async:abort": ["--async-mode", "fully-async", "--pause-generation-mode", "abort",
                          "--partial-rollout"],
}


def engine_idle(run_dir: Path, start: float, end: float,
                with_pauses: bool = True) -> float | None:
    """Share of engine time in [start, end] with no request running (down time left out;
    without `with_pauses`, the syncs' paused time left out too)."""
    rows = read_utilization(run_dir / "utilization.jsonl")["engine"]
    skip = {"down"} if with_pauses else {"down", "paused"}
    seen = idle = 0.0
    for r in rows:
        a, b = max(start, r["start_s"]), min(end, r["end_s"])
        if b <= a or r.get("state") in skip:
            continue
        seen += b - a
        if r.get("state") != "busy":
            idle += b - a
    return idle / seen if seen else None


def idle_causes(run_dir: Path, start: float, end: float) -> dict[str, float]:
    """Share of engine time in [start, end] (down and paused left out) idle for each cause
    (observe/idle_causes.py; `unknown`: idle rows written without a cause)."""
    rows = read_utilization(run_dir / "utilization.jsonl")["engine"]
    seen = 0.0
    idle: dict[str, float] = dict.fromkeys(CAUSES, 0.0)
    for r in rows:
        a, b = max(start, r["start_s"]), min(end, r["end_s"])
        if b <= a or r.get("state") in ("down", "paused"):
            continue
        seen += b - a
        if r.get("state") != "busy":
            cause = r.get("cause") or "unknown"
            idle[cause] = idle.get(cause, 0.0) + b - a
    return {k: v / seen for k, v in idle.items()} if seen else {}


def engine_fill(run_dir: Path, start: float, end: float) -> float | None:
    """Mean share of the engines' slots running a request over [start, end] (down and
    paused left out; idle counts 0): a slot left empty for a round trip lowers it even
    while the engine is busy. None when a busy row does not say (no max_running_requests)."""
    rows = read_utilization(run_dir / "utilization.jsonl")["engine"]
    seen = filled = 0.0
    for r in rows:
        a, b = max(start, r["start_s"]), min(end, r["end_s"])
        if b <= a or r.get("state") in ("down", "paused"):
            continue
        seen += b - a
        if r.get("state") == "busy":
            if r.get("fill") is None:
                return None
            filled += (b - a) * r["fill"]
    return filled / seen if seen else None


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def trainer_idle(run_dir: Path, start: float, end: float) -> float | None:
    rows = read_utilization(run_dir / "utilization.jsonl")["trainer"]
    busy = sum(b - a for a, b in _merged([(max(start, r["start_s"]), min(end, r["end_s"]))
                                          for r in rows]))
    return 1 - busy / (end - start) if end > start else None


def trainer_alone(run_dir: Path, start: float, end: float) -> float | None:
    """Share of [start, end] when the trainer works and no engine has a request running:
    on shared cores, the time one core has nothing to run (the trainer is one thread)."""
    rows = read_utilization(run_dir / "utilization.jsonl")
    clip = [(max(start, r["start_s"]), min(end, r["end_s"])) for r in rows["trainer"]]
    trainer = _merged(clip)
    engines = _merged([(max(start, r["start_s"]), min(end, r["end_s"]))
                       for r in rows["engine"] if r.get("state") == "busy"])
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in trainer for c, d in engines)
    alone = sum(b - a for a, b in trainer) - overlap
    return alone / (end - start) if end > start else None


def run_one(name: str, flags: list[str], config: str, steps: int, out: Path) -> dict:
    run_dir = out / name.replace(":", "-")
    args = parse_args(["--config", config, "--output-dir", str(run_dir), "--num-rollout",
                       str(steps), "--rollout-health-check-interval", "30", *flags])
    assert train(args) == 0, name
    ms = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start, end = ms[0]["time_s"], ms[-1]["time_s"]
    samples = sum(m["samples_returned"] for m in ms[1:])
    ages = [int(age) for m in ms for age, count in m["staleness"].items() for _ in range(count)]
    return {
        "mode": name, "steps": steps,
        "samples_per_s": samples / (end - start),
        "step_s": (end - start) / (len(ms) - 1),
        "rollout_s": statistics.median(m["rollout_s"] for m in ms[1:]),
        "train_sync_s": statistics.median(m["score_s"] + m["check_s"] + m["train_s"]
                                          + m["sync_s"] for m in ms[1:]),
        "engine_idle": engine_idle(run_dir, start, end),
        "engine_idle_unpaused": engine_idle(run_dir, start, end, with_pauses=False),
        "idle_causes": idle_causes(run_dir, start, end),
        "engine_fill": engine_fill(run_dir, start, end),
        "trainer_idle": trainer_idle(run_dir, start, end),
        "trainer_alone": trainer_alone(run_dir, start, end),
        "staleness_mean": sum(ages) / len(ages), "staleness_max": max(ages),
        "reward_first": ms[0]["reward_mean"], "reward_last": ms[-1]["reward_mean"],
        "logprob_diff_max": max(m["logprob_max_abs_diff"] for m in ms),
        "mixed_samples": sum(m.get("logprob_checked_mixed_samples", 0) for m in ms),
    }


def _cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the machine so far; guest time is already in user."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = t.user + t.system + idle + sum(getattr(t, k, 0.0) for k in
                                           ("nice", "irq", "softirq", "steal"))
    return total - idle, total


class SteadyCpu:
    """The machine's CPU busy share between a run's first and last metrics row.

    A thread samples psutil's CPU times every `interval_s` with the number of rows in the
    run's metrics.jsonl, so the window is the one the other figures use (start-up, the
    first sync and the report's rendering left out).
    """

    def __init__(self, metrics_path: Path, last_row: int, interval_s: float = 0.05):
        self.metrics_path = metrics_path
        self.last_row = last_row
        self.interval_s = interval_s
        self._first: tuple[float, float] | None = None   # (busy, total) CPU seconds
        self._last: tuple[float, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> SteadyCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _rows(self) -> int:
        try:
            return self.metrics_path.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s) and self._last is None:
            rows = self._rows()
            point = _cpu_seconds()
            if rows < 1:  # not started yet (or an earlier run's file was just moved away)
                self._first = None
            elif self._first is None:
                self._first = point
            if rows >= self.last_row:
                self._last = point

    def busy(self) -> float | None:
        if self._first is None or self._last is None or self._last[1] <= self._first[1]:
            return None
        return (self._last[0] - self._first[0]) / (self._last[1] - self._first[1])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "async_cpu.yaml"))
    p.add_argument("--steps", type=int, default=40,
                   help="steps per run (the first steps fill the producer's window)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-weight-staleness", type=int, default=None,
                   help="the fully-async runs' bound (default: the config's, else 1)")
    p.add_argument("--reference-min-step-ms", type=float, default=0.0,
                   help="a floor on each engine step, waited off the CPU (a GPU's decode "
                        "step): the schedules as on separate trainer and engine devices")
    p.add_argument("--engines", type=int, default=None,
                   help="rollout engines (one GPU slot each; default: the config's)")
    p.add_argument("--dispatch", default=None, metavar="ROUTER:POLICY,...",
                   help="run every mode once per router:policy (e.g. sglang-router:round_robin,"
                        "smg:least_load; POLICY admission: --rollout-dispatch admission, the "
                        "client binds each request to a free engine slot; admission:K with "
                        "--rollout-dispatch-queue K); default: the config's router and policy")
    p.add_argument("--out", default=None, help="run folders (default: a temp dir)")
    p.add_argument("--json-out", default=None)
    a, job_flags = p.parse_known_args(argv)  # the rest: job flags for every run
    out = Path(a.out or tempfile.mkdtemp(prefix="async-rl-"))
    if a.engines:
        job_flags = ["--rollout-num-gpus", str(a.engines), "--num-gpus-per-node",
                     str(a.engines + 1), *job_flags]
    dispatches = [d.split(":", 1) for d in a.dispatch.split(",")] if a.dispatch else [None]
    rows = []
    for name, dispatch in [(m, d) for m in a.modes.split(",") for d in dispatches]:
        flags = list(MODES[name]) + job_flags
        label = name
        if dispatch is not None:
            flags += ["--router", dispatch[0]]
            policy, _, queue = dispatch[1].partition(":")
            if policy == ADMISSION:
                flags += ["--rollout-dispatch", ADMISSION]
                flags += ["--rollout-dispatch-queue", queue] if queue else []
            else:
                flags += ["--router-policy", dispatch[1]]
            label = f"{name} {dispatch[0]}:{dispatch[1]}"
        if a.reference_min_step_ms:
            flags += ["--reference-min-step-ms", str(a.reference_min_step_ms)]
        if name.startswith("fully-async") and a.max_weight_staleness is not None:
            flags += ["--max-weight-staleness", str(a.max_weight_staleness)]
        folder = label.replace(":", "-").replace(" ", "_")
        with SteadyCpu(out / folder / "metrics.jsonl", last_row=a.steps) as cpu:
            row = run_one(folder, flags, a.config, a.steps, out)
        row["mode"], row["cpu_busy"] = label, cpu.busy()
        rows.append(row)
        print(f"[async_rl] {label}: {row['samples_per_s']:.1f} samples/s", flush=True)
    base = next((r for r in rows if r["mode"].split()[0] == "sync"), rows[0])
    bound = max(base["rollout_s"], base["train_sync_s"])
    floor = (f", engine steps of at least {a.reference_min_step_ms:g} ms"
             if a.reference_min_step_ms else "")
    print(f"\nconfig {a.config}{floor}, {a.steps} steps each; sync run: rollout "
          f"{base['rollout_s']:.3f}"
          f" s, train + sync {base['train_sync_s']:.3f} s -> overlap bound {bound:.3f} s/step\n")
    head = ("| mode | samples/s | vs sync | step s | vs bound | train + sync s | engine idle | "
            "engine idle w/o pauses | of which dispatch / sync edges / schedule | "
            "slots filled | "
            "trainer idle | trainer alone | "
            "staleness mean/max | reward first -> last | max logprob diff | mixed samples | "
            "CPU busy |")
    print(head)
    print("|" + "---|" * 17)
    for r in rows:
        r["vs_sync"] = r["samples_per_s"] / base["samples_per_s"]
        r["vs_bound"] = r["step_s"] / bound
        causes = r["idle_causes"]
        for key, group in (("idle_dispatch", DISPATCH), ("idle_sync_edges", SYNC_EDGES),
                           ("idle_schedule", SCHEDULE)):
            r[key] = sum(causes.get(c, 0.0) for c in group) if causes else None
        print(f"| {r['mode']} | {r['samples_per_s']:.1f} | {r['vs_sync']:.2f}x | "
              f"{r['step_s']:.3f} | {r['vs_bound']:.2f}x | {r['train_sync_s']:.3f} | "
              f"{_pct(r['engine_idle'])} | {_pct(r['engine_idle_unpaused'])} | "
              f"{_pct(r['idle_dispatch'])} / {_pct(r['idle_sync_edges'])} / "
              f"{_pct(r['idle_schedule'])} | {_pct(r['engine_fill'])} | "
              f"{_pct(r['trainer_idle'])} | {_pct(r['trainer_alone'])} | "
              f"{r['staleness_mean']:.2f}/{r['staleness_max']} | "
              f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} | "
              f"{r['logprob_diff_max']:.1e} | {r['mixed_samples']} | {_pct(r['cpu_busy'])} |")
    print("\nidle by cause (share of unpaused engine time; observe/idle_causes.py):")
    for r in rows:
        print(f"  {r['mode']}: " + ", ".join(f"{k} {_pct(v)}" for k, v in
                                            r["idle_causes"].items() if v))
    if a.json_out:  # each row with what produced it, so a results file can be re-read
        run = {"config": Path(a.config).name, "job_flags": job_flags, "engines": a.engines,
               "reference_min_step_ms": a.reference_min_step_ms,
               "max_weight_staleness": a.max_weight_staleness,
               "cpu_count": psutil.cpu_count(), "date": datetime.date.today().isoformat()}
        with open(a.json_out, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, **run}) + "\n")
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


if __name__ == "__main__":
    main()
