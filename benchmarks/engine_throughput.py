"""Aggregate decode throughput of the reference engine at 1, 8 and 32 concurrent requests.

Continuous batching must pay: one batched forward per decode step serves every running
request, so tokens/s at 32 concurrent requests should be well above the single-request
rate. The engine runs as a real server process pinned to one CPU core with one torch
thread; the clients run in this process and count completion tokens over wall time.

    python benchmarks/engine_throughput.py [--model-dir DIR] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slime_like.cluster.ports import free_port  # noqa: E402
from slime_like.models.tiny import make_tiny_model  # noqa: E402


def start_engine(model_dir: Path, cpu: int, max_running: int, log: Path) -> tuple[subprocess.Popen, str]:
    """The engine on one core: CPU affinity to `cpu`, one OpenMP (torch intra-op) thread."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slime_like.reference_engine", "--model-path", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--max-running-requests", str(max_running),
             "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        time.sleep(0.2)
    raise RuntimeError("engine not healthy in 120 s")


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="HF model dir (default: a fresh tiny model)")
    ap.add_argument("--tokens", type=int, default=128, help="max_new_tokens per request")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3, help="measurements per level (best is kept)")
    ap.add_argument("--cpu", type=int, default=None, help="core to pin the engine to (default: the last)")
    a = ap.parse_args()

    cpu = a.cpu if a.cpu is not None else max(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = a.model_dir or make_tiny_model(Path(tmp) / "tiny", seed=0)
        proc, url = start_engine(model_dir, cpu, max(a.levels), Path(tmp) / "engine.log")
        try:
            run_level(url, max(a.levels), 8, 1)  # warm the allocator and the threads
            rows = []
            for level in a.levels:
                # At least ~1000 tokens per measurement, so short runs don't favour any level.
                rounds = max(1, -(-1024 // (level * a.tokens)))
                best = max((run_level(url, level, a.tokens, rounds) for _ in range(a.repeats)),
                           key=lambda r: r[0])
                rows.append((level, *best))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
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
