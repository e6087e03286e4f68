"""What a fleet costs as it grows: the real fleet at N engines, side by side in one run.

    python benchmarks/fleet_scale.py --engines 1 4 16          # this machine (2 cores: to 16)
    python benchmarks/fleet_scale.py --engines 64 --json rows.jsonl    # one N per command
    python benchmarks/fleet_scale.py --engines 16 --router smg --rl-plane --only-syncs

For each N it starts a fresh Ray cluster of simulated nodes (`ray.cluster_utils.Cluster`,
one node of 8 declared GPUs per 8 engines, on 127.0.0.2, 127.0.0.3, ...), launches the
real fleet (`slime_like.api.launch_fleet`: sglang-router, reference engines with the tiny
model) and measures, with a client sending requests through the router throughout:

- launch: `launch_fleet` until every engine is LOADED, then the first sync until every
  engine is routed at version 1;
- a steady sync (the median of `--syncs`): its wall time, the transfer (data) and the
  rest (control calls: pause, begin, end, flush, continue, routing);
- a hung engine: steps of a sync and a short rollout (`--steps`, their median), then one
  engine SIGSTOPped just before a step's sync: that step's time and its ratio to the
  median (the target: at most 3x), and when the health monitor declared the engine dead
  (the sync held it SUSPECT meanwhile, out of the router); then the same with the engine
  continued right after its step: it is resynced in place (SIGCONT -> routed again);
- the health monitor: driver CPU per round (and per engine), and its round's wall time;
- one engine SIGKILLed (by this driver, at the server's pid; `--kills K`: K engines in turn,
  each back before the next dies, and the median of each figure): detection (kill -> DEAD;
  "exited": kill -> the process's exit, once the kernel has freed its memory (its pidfd
  readable: from then on its actor can reap it); "seen": kill -> the exit watcher's
  finding; "unroute": the rest, the router's removal and the fleet's lock, which the DEAD
  event's `after_seen_ms` gives),
  recovery (kill -> routed again at the fleet's version), and the others' requests/s during
  the first one's recovery against before it;
- elastic membership: a node joins and 8 engines are added on it (until each serves at the
  fleet's version), 8 of the first engines are drained (requests moved), and the next push
  regroups without them;
- the end: `fleet.shutdown()` until every engine process is gone.

`--router smg` runs the fleet behind smg instead; `--rl-plane` with it starts smg with
`--enable-rl`, so each sync's pause and continue reach the engines in one smg request per
step (`rl_plane_reached`: how many engines it reached in the last steady sync's pause);
`--only-syncs` stops after the steady syncs (the control plane's figures, side by side);
`--only detect` skips the hung engine and stops after the kills.

Rows print with their ratio to the N = 4 row where one ran (or the first row's); `--json`
appends them, so runs of one N each can be put side by side (`--table FILE` prints them).
What bounds each figure: on a CPU machine the engines, the router, Ray and this driver
share the cores, so "cpu busy" (the machine's, over the run) says when cores, not the
fleet's design, set a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray
import requests
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slime_like.api import (  # noqa: E402
    FleetEvent,
    FleetLayout,
    FleetWeights,
    HealthSettings,
    RouterSettings,
    launch_fleet,
)
from slime_like.models import load_pretrained  # noqa: E402
from slime_like.models.tiny import make_tiny_model  # noqa: E402

ENGINES_PER_NODE = 8
#: a kill's detection and its parts (`_kills`)
DETECTION_PARTS = ("detect_s", "detect_exited_s", "detect_seen_s", "detect_unroute_s")


class Timeline:
    """Every lifecycle event, with the time it was seen."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str, str]] = []
        self.after_seen_ms: dict[tuple[str, float], float] = {}  # (engine, time): its detail
        self.lock = threading.Lock()

    def __call__(self, event: FleetEvent) -> None:
        now = time.time()
        with self.lock:
            self.events.append((now, event.subject, event.kind.value,
                                str(event.details.get("version", ""))))
            if "after_seen_ms" in event.details:
                self.after_seen_ms[(event.subject, now)] = event.details["after_seen_ms"]

    def wait(self, engine: str, state: str, after: float, timeout: float = 600.0) -> float:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                for t, subject, kind, _ in self.events:
                    if subject == engine and kind == state and t >= after:
                        return t
            time.sleep(0.01)
        raise TimeoutError(f"{engine} did not reach {state} within {timeout}s")


class Load:
    """Requests through the router from a few threads; completions counted by time."""

    def __init__(self, url: str, api_key: str | None, threads: int):
        self.url, self.done, self.failed = url + "/generate", [], 0
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        body = {"text": "Say a: ", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        with requests.Session() as s:
            while not self.stop.is_set():
                try:
                    s.post(self.url, json=body, headers=self.headers, timeout=60).raise_for_status()
                    self.done.append(time.time())
                except requests.RequestException:
                    self.failed += 1
                    time.sleep(0.05)

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in list(self.done)) / max(1e-9, end - start)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=70)


def _server_pids(fleet) -> set[int]:
    """Every engine server process of the fleet now (each actor's child)."""
    return set(ray.get([a.server_pid.remote() for e in fleet.engines for a in e.actors]))


def _engine_processes(pids: set[int]) -> list[psutil.Process]:
    """The engine servers among `pids` still running (a zombie has exited)."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _health_round_cost(fleet, seconds: float) -> dict:
    """Driver CPU per health round over `seconds` of an idle fleet (no sync, no load)."""
    monitor = fleet.health.monitor
    me = psutil.Process()
    rounds0, cpu0 = monitor.rounds, sum(me.cpu_times()[:2])
    time.sleep(seconds)
    rounds = monitor.rounds - rounds0
    cpu = sum(me.cpu_times()[:2]) - cpu0
    return {"health_rounds": rounds, "health_cpu_ms_per_round": 1e3 * cpu / max(1, rounds),
            "health_round_ms": 1e3 * statistics.median(list(monitor.round_seconds)[-max(1, rounds):] or [0.0])}


def _step(fleet, weights: FleetWeights, model, prompts: list[list[int]]) -> tuple[float, float]:
    """One training step's fleet work: a sync of new weights, then a short rollout; the
    step's seconds and its sync's."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999)
    t = time.time()
    weights.push(model)
    synced = time.time() - t
    fleet.generate(prompts, 1, {"max_new_tokens": 8, "temperature": 0.0})
    return time.time() - t, synced


def _hung_engine(fleet, weights: FleetWeights, model, timeline: Timeline,
                 args: argparse.Namespace) -> dict:
    """The step after a SIGSTOP against the median step; the monitor's verdict; and an
    engine continued right after its step, resynced in place."""
    n = len(fleet.engines)
    prompts = [[1, 72 + i % 50, 105] for i in range(2 * n)]
    steps = [_step(fleet, weights, model, prompts) for _ in range(args.steps)]
    row = {"median_step_s": statistics.median(t for t, _ in steps),
           "median_step_sync_s": statistics.median(s for _, s in steps)}
    # Each case stops an engine the last syncs went to, after a step with every engine:
    # a sync whose engine set changed (one relaunched, or back from a resync) first asks
    # every engine's /server_info or /model_info, calls with no deadline of their own.
    for case, e in (("continued", fleet.engines[1]), ("dead", fleet.engines[0])):
        _step(fleet, weights, model, prompts)
        pid = ray.get(e.actors[0].server_pid.remote())
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)  # just before the step's sync
        try:
            took, synced = _step(fleet, weights, model, prompts)
            if case == "continued":
                os.kill(pid, signal.SIGCONT)
                resumed_at = time.time()
            else:
                dead = timeline.wait(e.engine_id, "DEAD", stopped_at)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        back = timeline.wait(e.engine_id, "REGISTERED", stopped_at)
        if case == "dead":
            version = timeline.wait("fleet", "VERSION", stopped_at)
            row.update(stop_step_s=took, stop_step_sync_s=synced,
                       stop_step_ratio=took / row["median_step_s"],
                       stop_dead_s=dead - stopped_at, stop_back_s=back - stopped_at,
                       stop_landed_before_dead=version < dead)
        else:
            same = ray.get(e.actors[0].server_pid.remote()) == pid
            with timeline.lock:
                deaths = [t for t, subject, kind, _ in timeline.events
                          if subject == e.engine_id and kind == "DEAD" and t >= stopped_at]
            row.update(cont_step_s=took, cont_step_sync_s=synced,
                       cont_step_ratio=took / row["median_step_s"],
                       cont_resync_s=back - resumed_at,
                       cont_resynced_in_place=same and not deaths)
        assert fleet.wait_recovered(timeout=300), "the stopped engine did not come back"
    return row


def _kills(fleet, timeline: Timeline, count: int) -> list[dict]:
    """SIGKILL `count` engines in turn (the last ones: each is back, routed at the fleet's
    version, before the next dies): each one's detection, its split and its recovery.

    The crash itself is timed: a SIGKILL from this driver to the server's pid (the nodes
    are simulated on this host), so detection starts at the crash, not at the dispatch of
    a Ray call asking the engine's actor to crash it (which grows with the host's load;
    `actor_call_s`, the round trip just before, says by how much)."""
    out = []
    for k in range(count):
        victim = fleet.engines[len(fleet.engines) - 1 - k % len(fleet.engines)]
        t = time.time()
        pid = ray.get(victim.actors[0].server_pid.remote())
        actor_call_s = time.time() - t
        engine = victim.engine_id
        process_fd = os.pidfd_open(pid)  # readable once its last thread is done
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        # the kernel's part: the process has exited once its memory is freed (before that
        # it cannot be reaped); blocking on its pidfd costs this driver nothing meanwhile
        select.select([process_fd], [], [], 30)
        exited = time.time() - killed_at
        os.close(process_fd)
        dead = timeline.wait(engine, "DEAD", killed_at)
        back = timeline.wait(engine, "REGISTERED", dead)
        # of the detection, after the exit watcher saw the death: the router's removal
        # and the fleet's lock (the DEAD event's `after_seen_ms`)
        after_seen = timeline.after_seen_ms.get((engine, dead))
        detect = dead - killed_at
        out.append({"killed_at": killed_at, "back_at": back, "actor_call_s": actor_call_s,
                    "detect_s": detect, "detect_exited_s": exited,
                    "detect_seen_s": None if after_seen is None else detect - after_seen / 1e3,
                    "detect_unroute_s": None if after_seen is None else after_seen / 1e3})
    return out


def _busy_cpu_s() -> float:
    """The machine's CPU seconds not idle so far (every core)."""
    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) \
        + getattr(t, "softirq", 0.0)


def _launch_spread(timeline: Timeline, t0: float) -> dict:
    """When the first, the median and the last engine was LOADED after the launch began:
    a launch bound by the cores rises evenly, one bound by a serial step has a tail."""
    with timeline.lock:
        loaded = sorted({subject: t for t, subject, kind, _ in reversed(timeline.events)
                         if kind == "LOADED" and t >= t0}.values())
    if not loaded:
        return {}
    return {"launch_first_loaded_s": loaded[0] - t0,
            "launch_median_loaded_s": statistics.median(loaded) - t0,
            "launch_last_loaded_s": loaded[-1] - t0}


def measure(n: int, args: argparse.Namespace, work: Path) -> dict:
    """Every figure of one fleet of `n` engines, on a fresh cluster."""
    from ray.cluster_utils import Cluster

    nodes = -(-n // ENGINES_PER_NODE)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0,
                                                            "include_dashboard": False})
    for i in range(nodes):
        cluster.add_node(num_cpus=ENGINES_PER_NODE * 2, num_gpus=ENGINES_PER_NODE,
                         node_ip_address=f"127.0.0.{i + 2}")
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    log_dir = work / f"logs-{n}"
    timeline = Timeline()
    row: dict = {"engines": n, "nodes": nodes, "router": args.router,
                 "rl_plane": bool(args.rl_plane)}
    psutil.cpu_percent()  # the machine's busy share from here on
    busy0 = _busy_cpu_s()
    t0 = time.time()
    fleet = launch_fleet(None, model_path=args.model, engine="reference", log_dir=log_dir,
                         on_event=timeline, layout=FleetLayout(num_gpus=n),
                         router=RouterSettings(kind=args.router,
                                               flags={"enable_rl": True} if args.rl_plane
                                               else {}),
                         health=HealthSettings(enabled=True, interval_s=args.probe_interval,
                                               timeout_s=args.probe_timeout, first_wait_s=0.0,
                                               failure_threshold=2))
    load = None
    pids: set[int] = set()  # every engine server seen: none may outlive the shutdown
    try:
        row["launch_s"] = time.time() - t0
        row.update(_launch_spread(timeline, t0))
        # Where a launch bound by the cores spends them: the machine's CPU seconds per
        # engine, and the part the engine processes themselves used.
        row["launch_cpu_s_per_engine"] = (_busy_cpu_s() - busy0) / n
        pids = _server_pids(fleet)
        row["engine_process_cpu_s"] = sum(
            sum(p.cpu_times()[:2]) for p in _engine_processes(pids)) / n
        model = load_pretrained(args.model, dtype=torch.float32)
        weights = FleetWeights(fleet, transport="distributed", update_weight_buffer_size=1 << 20)
        t1 = time.time()
        weights.push(model)
        row["first_sync_s"] = time.time() - t1
        row["launch_to_serving_s"] = time.time() - t0
        # Steady syncs with no request client in this process: its threads would take the
        # GIL from the sync's (a job generates from the driver too, but that is its load).
        walls, data = [], []
        for _ in range(args.syncs):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.999)
            t = time.time()
            report = weights.push(model)
            walls.append(time.time() - t)
            seconds = report.get("seconds", {}) if isinstance(report, dict) else report.seconds
            data.append(seconds.get("transfer", 0.0))
        row["sync_s"] = statistics.median(walls)
        row["sync_data_s"] = statistics.median(data)
        row["sync_control_s"] = row["sync_s"] - row["sync_data_s"]
        row["rl_plane_reached"] = len((report.get("via_rl_plane") or {}).get(
            "pause_generation", []))
        if args.only_syncs:
            weights.close()
            return row
        if n > 1 and args.only != "detect":  # a hang is told from the others' answers
            row.update(_hung_engine(fleet, weights, model, timeline, args))
        if args.only == "hung":
            weights.close()
            return row
        row.update(_health_round_cost(fleet, args.health_window))
        row["health_cpu_ms_per_engine"] = row["health_cpu_ms_per_round"] / n
        load = Load(fleet.router_url(), fleet.settings.router.api_key, threads=args.clients)
        time.sleep(args.rate_window)
        kills = _kills(fleet, timeline, args.kills)
        killed_at, back = kills[0]["killed_at"], kills[0]["back_at"]
        row["actor_call_s"] = statistics.median(k["actor_call_s"] for k in kills)
        # the median of the kills: one crash's detection is a few tens of ms, and one
        # scheduler hiccup on a loaded host moves it by as much
        for key in DETECTION_PARTS:
            values = [k[key] for k in kills if k[key] is not None]
            row[key] = statistics.median(values) if values else None
        row["detect_each_s"] = [round(k["detect_s"], 4) for k in kills]
        row["kills"] = [{key: None if k[key] is None else round(k[key], 4)
                         for key in DETECTION_PARTS} for k in kills]
        row["recovery_s"] = back - killed_at
        before = load.rate(killed_at - args.rate_window, killed_at)
        during = load.rate(killed_at, back)
        # the others' share: the killed engine served 1/n of the requests before
        row["others_rps_before"] = before * (n - 1) / n if n > 1 else 0.0
        row["others_rps_during"] = during
        row["others_rps_ratio"] = during / row["others_rps_before"] if n > 1 and before else None
        if args.only == "detect":
            load.close()
            load = None
            weights.close()
            return row
        # Elastic membership: a node joins and 8 engines are added on it while the load
        # runs; then 8 of the first engines are drained (the next push regroups without them).
        cluster.add_node(num_cpus=ENGINES_PER_NODE * 2, num_gpus=ENGINES_PER_NODE,
                         node_ip_address=f"127.0.0.{nodes + 2}")
        t = time.time()
        fleet.add_engines(ENGINES_PER_NODE, timeout_s=600)
        row["add8_s"] = time.time() - t
        leaving = [e.engine_id for e in fleet.engines][:min(ENGINES_PER_NODE, n)]
        t = time.time()
        drained = fleet.drain(leaving, deadline_s=args.drain_deadline)
        row["drain8_s"] = time.time() - t
        row["drain8_moved"] = drained.moved
        t = time.time()
        weights.push(model)  # the regroup: the drained engines leave the group and stop
        row["regroup_sync_s"] = time.time() - t
        load.close()
        load = None
        weights.close()
    finally:
        if load is not None:
            load.close()
        with contextlib.suppress(Exception):  # every server the fleet has now (relaunches too)
            pids |= _server_pids(fleet)
        t2 = time.time()
        fleet.shutdown()
        deadline = time.time() + 120
        while _engine_processes(pids) and time.time() < deadline:
            time.sleep(0.05)
        row["shutdown_s"] = time.time() - t2
        row["leftover_engines"] = len(_engine_processes(pids))
        row["cpu_busy"] = psutil.cpu_percent() / 100
        ray.shutdown()
        cluster.shutdown()
    return row


FIELDS = [("launch_s", "launch"), ("first_sync_s", "1st sync"),
          ("launch_to_serving_s", "to serving"), ("sync_s", "sync"),
          ("sync_control_s", "control"), ("sync_data_s", "data"),
          ("median_step_s", "step"), ("stop_step_s", "stop step"),
          ("stop_step_ratio", "stop/step"), ("stop_dead_s", "stop dead"),
          ("cont_resync_s", "cont rsync"),
          ("health_cpu_ms_per_round", "hc ms/rnd"), ("health_round_ms", "rnd ms"),
          ("detect_s", "detect"), ("detect_exited_s", "exited"), ("detect_seen_s", "seen"),
          ("detect_unroute_s", "unroute"),
          ("recovery_s", "recover"),
          ("others_rps_ratio", "others rps"), ("add8_s", "add 8"), ("drain8_s", "drain 8"),
          ("shutdown_s", "shutdown"),
          ("cpu_busy", "cpu busy")]


def print_table(rows: list[dict]) -> None:
    """Each row, then each row's ratio to the N = 4 row (or the first)."""
    base = next((r for r in rows if r["engines"] == 4), rows[0])
    print(f"{'N':>4} " + " ".join(f"{label:>10}" for _, label in FIELDS))
    for r in rows:
        print(f"{r['engines']:>4} " + " ".join(
            f"{r[k]:10.3f}" if isinstance(r.get(k), float | int) else f"{'-':>10}"
            for k, _ in FIELDS))
    print(f"ratio to N = {base['engines']}:")
    for r in rows:
        cells = []
        for k, _ in FIELDS:
            a, b = r.get(k), base.get(k)
            cells.append(f"{a / b:9.2f}x" if isinstance(a, float | int) and b else f"{'-':>10}")
        print(f"{r['engines']:>4} " + " ".join(cells))
    for r in rows:  # where the cores are the bound, the cost per engine says more
        if r["engines"] > 1 and r.get("sync_control_s") is not None:
            marginal = (r["sync_control_s"] - base["sync_control_s"]) / max(
                1, r["engines"] - base["engines"]) if r is not base else None
            print(f"N={r['engines']}: control per engine {1e3 * r['sync_control_s'] / r['engines']:.2f} ms"
                  + (f", marginal vs N={base['engines']}: {1e3 * marginal:.2f} ms"
                     if marginal is not None else ""))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--steps", type=int, default=8,
                   help="steps (a sync and a short rollout) before an engine is SIGSTOPped")
    p.add_argument("--only", choices=["hung", "detect"], default=None,
                   help="hung: launch, first sync, the SIGSTOP steps, shutdown; detect: "
                        "launch, syncs, the health round and the kills, shutdown")
    p.add_argument("--kills", type=int, default=1,
                   help="engines SIGKILLed in turn (detection: their median)")
    p.add_argument("--clients", type=int, default=4, help="request threads through the router")
    p.add_argument("--probe-interval", type=float, default=1.0)
    p.add_argument("--probe-timeout", type=float, default=5.0)
    p.add_argument("--health-window", type=float, default=5.0)
    p.add_argument("--rate-window", type=float, default=3.0)
    p.add_argument("--drain-deadline", type=float, default=2.0)
    p.add_argument("--router", choices=["sglang-router", "smg"], default="sglang-router")
    p.add_argument("--rl-plane", action="store_true",
                   help="with --router smg: pause and continue through smg's RL control plane")
    p.add_argument("--only-syncs", action="store_true",
                   help="stop after the steady syncs (no kill, add, drain)")
    p.add_argument("--json", default=None, help="append each row as a JSON line")
    p.add_argument("--table", default=None, help="print the rows of this JSON-lines file")
    a = p.parse_args(argv)
    if a.rl_plane and a.router != "smg":
        p.error("--rl-plane: smg's RL control plane needs --router smg")
    if a.table:
        rows = [json.loads(x) for x in Path(a.table).read_text().splitlines() if x.strip()]
        print_table(rows)
        return rows
    work = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    a.model = str(make_tiny_model(work / "model", seed=0))
    rows = []
    for n in a.engines:
        row = measure(n, a, work)
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
