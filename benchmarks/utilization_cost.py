"""What watching the engines costs: decode throughput with and without the load sampler.

`observe.utilization.EngineUtilization` polls every engine's `/v1/loads` while a job runs.
This runs one reference engine (pinned to one core, one torch thread), measures decode
tokens/s of a batch of concurrent requests without the sampler and with it at 100 ms,
50 ms (the default) and 10 ms, interleaved over `--repeats` rounds, and prints each mode's median
tokens/s and its ratio to the unwatched run, plus the polls made and the engine's share of
observed time it saw as busy.

The reference engine answers `/v1/loads` in its one Python process, beside the scheduler
thread, so on CPU every poll takes a little from decoding; sglang answers it outside the
scheduler process.

    python benchmarks/utilization_cost.py [--tokens 768] [--concurrency 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine_throughput import run_level, start_engine  # noqa: E402
from slime_like.engine.address import EngineAddress  # noqa: E402
from slime_like.engine.session import EngineSession  # noqa: E402
from slime_like.models.tiny import make_tiny_model  # noqa: E402
from slime_like.observe.utilization import EngineUtilization  # noqa: E402

MODES = (("no sampler", None), ("poll 100 ms", 0.1), ("poll 50 ms", 0.05), ("poll 10 ms", 0.01))


def measure(url: str, interval_s: float | None, concurrency: int, tokens: int
            ) -> tuple[float, int, float | None]:
    """(tokens/s, polls, busy share seen) of one wave of requests, watched or not."""
    util = None
    if interval_s is not None:
        util = EngineUtilization(lambda: [EngineSession(EngineAddress(url, engine_id="e0"))],
                                 interval_s=interval_s).start()
    t0 = time.time()
    try:
        tps, _, _ = run_level(url, concurrency, tokens, 1)
    finally:
        t1 = time.time()
        if util is not None:
            util.stop()
    if util is None:
        return tps, 0, None
    idle = util.idle_ratio(t0, t1)
    return tps, util.polls, None if idle is None else 1.0 - idle


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=768, help="max_new_tokens per request")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=None, help="engine core (default: the last)")
    a = ap.parse_args()
    cpu = a.cpu if a.cpu is not None else max(os.sched_getaffinity(0))
    results: dict[str, list[tuple[float, int, float | None]]] = {m: [] for m, _ in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0)
        proc, url = start_engine(model_dir, cpu, a.concurrency, Path(tmp) / "engine.log")
        try:
            run_level(url, a.concurrency, 8, 1)  # warm-up
            for _ in range(a.repeats):
                for name, interval in MODES:
                    results[name].append(measure(url, interval, a.concurrency, a.tokens))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    base = statistics.median(r[0] for r in results["no sampler"])
    print(f"decode throughput watched and unwatched (1 engine on 1 core, {a.concurrency} "
          f"concurrent x {a.tokens} tokens, median of {a.repeats})")
    print(f"{'mode':>12} {'tokens/s':>10} {'vs none':>8} {'polls':>6} {'busy seen':>10}")
    for name, _ in MODES:
        rows = results[name]
        tps = statistics.median(r[0] for r in rows)
        polls = statistics.median(r[1] for r in rows)
        busy = [r[2] for r in rows if r[2] is not None]
        seen = f"{100 * statistics.median(busy):.1f}%" if busy else "-"
        print(f"{name:>12} {tps:>10.0f} {tps / base:>7.3f}x {polls:>6.0f} {seen:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
