"""Round trips of a weight sync's control calls against one reference engine, one by one.

Each call goes through `EngineClient` (one keep-alive connection), the way a sync sends it:
pause (retract), begin, end, continue, plus /ping and /model_info for scale. Prints one
JSON line with the median and p90 milliseconds of each over `--repeats` cycles.

    python benchmarks/control_plane.py                 # engine on CPU
    python benchmarks/control_plane.py --device cuda   # engine on GPU 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.weight_sync import Engines, EngineSpec, layout_config, write_model_dir  # noqa: E402
from slime_like.engine.client import EngineClient  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="control-plane-") as work:
        model_dir = write_model_dir(layout_config("tiny_dense"), Path(work))
        engines = Engines(model_dir, [EngineSpec("A", 1, 0)], args.device == "cuda", Path(work))
        try:
            client = EngineClient(engines.urls[0])
            calls = {
                "ping": client.ping,
                "model_info": client.model_info,
                "pause": lambda: client.pause_generation("retract"),
                "begin": client.begin_weight_update,
                "end": client.end_weight_update,
                "continue": client.continue_generation,
            }
            samples: dict[str, list[float]] = {name: [] for name in calls}
            for i in range(args.repeats + 10):
                for name, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    if i >= 10:  # warm-up cycles left out
                        samples[name].append(time.perf_counter() - t0)
        finally:
            engines.stop()
    record = {"bench": "control_plane", "engine_device": args.device, "repeats": args.repeats}
    for name, xs in samples.items():
        xs.sort()
        record[name] = {"median_ms": round(statistics.median(xs) * 1e3, 4),
                        "p90_ms": round(xs[int(len(xs) * 0.9)] * 1e3, 4)}
    line = json.dumps(record)
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
