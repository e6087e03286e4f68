"""Aggregate decode throughput of the reference engine at 1, 8 and 32 concurrent requests.

Continuous batching must pay: one batched forward per decode step serves every running
request, so tokens/s at 32 concurrent requests should be well above the single-request
rate. The engine runs as a real server process pinned to one CPU core with one torch
thread; the clients run in this process and count completion tokens over wall time.

    python benchmarks/engine_throughput.py [--model-dir DIR] [--tokens 128] [--repeats 3]

`--compare-served-log` measures the engine's served log (reference_engine/served_log.py,
one JSONL line per finished request) side by side: the same levels with the log off and
on, engines started alternately on the same core, and the cost per request printed.

    python benchmarks/engine_throughput.py --compare-served-log --tokens 4 --levels 1 32
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slime_like.models.tiny import make_tiny_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pinned_engine import start_pinned_engine  # noqa: E402

from slime_like.reference_engine.served_log import SERVED_LOG_ENV, ServedLog  # noqa: E402


def run_level(url: str, concurrency: int, tokens: int, rounds: int) -> tuple[float, int, float]:
    """(decode tokens/s, tokens, seconds) for `rounds` waves of `concurrency` requests."""
    session_local = {}

    def one(i: int) -> int:
        s = session_local.setdefault(os.getpid(), requests.Session())
        r = s.post(url + "/generate", json={
            "text": f"request {i}: the quick brown fox jumps over the lazy dog",
            "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True,
                                "sampling_seed": i}}, timeout=600)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    n = concurrency * rounds
    with cf.ThreadPoolExecutor(concurrency) as ex:
        t0 = time.perf_counter()
        total = sum(ex.map(one, range(n)))
        dt = time.perf_counter() - t0
    return total / dt, total, dt


def measure(a: argparse.Namespace, model_dir: Path, cpu: int, tmp: Path,
            env: dict[str, str] | None = None) -> list[tuple[int, float, int, float]]:
    """(concurrency, tokens/s, tokens, seconds) per level, the best of `a.repeats`, on a
    fresh engine started with `env`."""
    engine = start_pinned_engine(model_dir, cpu, tmp / "engine.log",
                                 "--max-running-requests", str(max(a.levels)), env=env)
    try:
        run_level(engine.url, max(a.levels), 8, 1)  # warm the allocator and the threads
        rows = []
        for level in a.levels:
            # At least ~1000 tokens per measurement, so short runs don't favour any level.
            rounds = max(1, -(-1024 // (level * a.tokens)))
            best = max((run_level(engine.url, level, a.tokens, rounds)
                        for _ in range(a.repeats)), key=lambda r: r[0])
            rows.append((level, *best))
    finally:
        engine.stop()
    return rows


def compare_served_log(a: argparse.Namespace, model_dir: Path, cpu: int, tmp: Path) -> int:
    """The levels with the served log off and on, alternated `a.rounds` times; per level
    the best requests/s of each and the cost of the log per request."""
    best: dict[tuple[str, int], float] = {}
    lines = 0
    for i in range(a.rounds):
        for mode in ("off", "on"):
            log = tmp / f"served-{i}.jsonl"
            env = {SERVED_LOG_ENV: str(log)} if mode == "on" else None
            for level, tps, _total, _dt in measure(a, model_dir, cpu, tmp, env):
                rps = tps / a.tokens
                best[mode, level] = max(best.get((mode, level), 0.0), rps)
            if mode == "on":
                lines += len(log.read_text().splitlines())
    print(f"served log off/on (1 core, 1 torch thread, {a.tokens} new tokens/request, best of "
          f"{a.rounds} alternated rounds x {a.repeats}; {lines} lines written)")
    print(f"{'concurrent':>10} {'req/s off':>10} {'req/s on':>10} {'on/off':>7} {'us/req':>8}")
    for level in a.levels:
        off, on = best["off", level], best["on", level]
        print(f"{level:>10} {off:>10.1f} {on:>10.1f} {on / off:>7.3f} "
              f"{(1 / on - 1 / off) * 1e6:>8.1f}")
    # What the scheduler thread itself spends (no server, no HTTP, no other process's
    # noise): a record per finished request and one flush per step that finished some.
    print("the served log's own cost on the scheduler thread, per request")
    for per_step in a.levels:
        cost = min(log_cost(tmp / "direct.jsonl", per_step) for _ in range(5))
        print(f"{per_step:>10} finished per step: {cost * 1e6:.2f} us")
    return 0


def log_cost(path: Path, per_step: int, requests: int = 20000) -> float:
    """Seconds per request of ServedLog.record plus its share of the step's flush."""
    log = ServedLog(path)
    t0 = time.perf_counter()
    for i in range(requests):
        log.record(f"rid-{i:08d}", "12", "length", 4)
        if (i + 1) % per_step == 0:
            log.flush()
    log.flush()
    dt = time.perf_counter() - t0
    log.close()
    path.unlink()
    return dt / requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="HF model dir (default: a fresh tiny model)")
    ap.add_argument("--tokens", type=int, default=128, help="max_new_tokens per request")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3, help="measurements per level (best is kept)")
    ap.add_argument("--cpu", type=int, default=None, help="core to pin the engine to (default: the last)")
    ap.add_argument("--compare-served-log", action="store_true",
                    help="the levels with the engine's served log off and on, side by side")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of off/on (compare)")
    a = ap.parse_args()

    cpu = a.cpu if a.cpu is not None else max(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = a.model_dir or make_tiny_model(Path(tmp) / "tiny", seed=0)
        if a.compare_served_log:
            return compare_served_log(a, model_dir, cpu, Path(tmp))
        rows = measure(a, model_dir, cpu, Path(tmp))
    base = rows[0][1]
    print(f"reference engine decode throughput (1 core, 1 torch thread, {a.tokens} new tokens/request)")
    print(f"{'concurrent':>10} {'tokens':>8} {'seconds':>8} {'tokens/s':>10} {'vs 1':>6}")
    for level, tps, total, dt in rows:
        print(f"{level:>10} {total:>8} {dt:>8.2f} {tps:>10.0f} {tps / base:>5.1f}x")
    ratio = rows[-1][1] / base
    print(f"batched/unbatched at {rows[-1][0]} concurrent: {ratio:.1f}x (target >= 5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
