"""Median seconds (and GB/s) of each step phase in a run's metrics.jsonl, first step left out.

With --d2d (on the GPU the run used) it also times a device-to-device copy of the sync's
bytes, one buffer, and prints the sync's ratio to it.

    python benchmarks/job_phases.py RUN_DIR/metrics.jsonl [--d2d] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PHASES = ("trainer_offload", "rollout", "trainer_onload", "score", "engine_release", "check",
          "train", "engine_resume", "sync", "step")


def medians(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    details = [r["sync_detail_ms"] for r in rows if isinstance(r.get("sync_detail_ms"), dict)]
    for key in sorted({k for d in details for k in d}):
        values = [d[key] for d in details if isinstance(d.get(key), int | float)]
        out[f"sync_ms_{key}"] = round(statistics.median(values), 3)
    for key in ("sync_requests", "sync_pack_s", "sync_gb"):
        values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        if values:
            out[key] = round(statistics.median(values), 5)
    for phase in PHASES:
        for suffix in ("_s", "_gbps", "_gb"):
            values = [r[phase + suffix] for r in rows if isinstance(r.get(phase + suffix), int | float)]
            if values:
                out[phase + suffix] = round(statistics.median(values), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", type=Path)
    ap.add_argument("--label", default="")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--d2d", action="store_true", help="time a d2d copy of the sync's bytes")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    m = medians(rows[1:] or rows)
    print(f"== {args.label or args.metrics} ({len(rows)} steps, medians of steps 1..)")
    for phase in PHASES:
        if phase + "_s" in m:
            rate = f"{m[phase + '_gbps']:>9.2f} GB/s" if phase + "_gbps" in m else ""
            print(f"{phase:<18}{m[phase + '_s']:>10.4f} s {rate}")
    if "sync_requests" in m:
        print(f"sync: {m['sync_requests']:g} update requests, pack {m['sync_pack_s'] * 1e3:.2f} ms")
    detail = {k.removeprefix("sync_ms_"): v for k, v in m.items() if k.startswith("sync_ms_")}
    if detail:
        print("sync, ms: " + ", ".join(f"{k} {v:g}" for k, v in detail.items()))
    if args.d2d and m.get("sync_gb"):
        from colocate import link_rates  # the colocate benchmark's link measurement

        nbytes = int(m["sync_gb"] * 1e9)
        m["d2d_one_buffer_s"] = round(nbytes / link_rates(True, nbytes)["d2d"], 6)
        m["sync_over_d2d"] = round(m["sync_s"] / m["d2d_one_buffer_s"], 2)
        print(f"sync {m['sync_s'] * 1e3:.1f} ms for {m['sync_gb']:.2f} GB; d2d one buffer "
              f"{m['d2d_one_buffer_s'] * 1e3:.2f} ms: {m['sync_over_d2d']:.2f}x")
    if args.json_out:
        with args.json_out.open("a") as f:
            f.write(json.dumps({"label": args.label, "steps": len(rows), **m}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
