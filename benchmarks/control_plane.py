"""Round trips of a weight sync's control calls, on the engine's two HTTP stacks side by side.

Two reference engines run at once: one on its default stack (`--reference-http-stack auto`:
uvloop and httptools, as sglang serves) and one on the pure-Python stack (`asyncio`: the
standard event loop and h11). Each call goes through `EngineClient` (one keep-alive
connection), the way a sync sends it: pause (retract), begin, end, continue, plus /ping and
/model_info for scale. The cycles alternate between the engines, so both see the same
machine. Prints one JSON line: the median and p90 milliseconds of each call on each stack,
and the ratio of the medians (auto / asyncio).

    python benchmarks/control_plane.py                 # engines on CPU
    python benchmarks/control_plane.py --device cuda   # engines on GPU 0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.records import emit, latency_ms  # noqa: E402
from benchmarks.weight_sync import Engines, EngineSpec, layout_config, write_model_dir  # noqa: E402
from slime_like.engine.client import EngineClient  # noqa: E402

STACKS = ("auto", "asyncio")
WARMUP_CYCLES = 10


def _calls(client: EngineClient) -> dict:
    return {
        "ping": client.ping,
        "model_info": client.model_info,
        "pause": lambda: client.pause_generation("retract"),
        "begin": client.begin_weight_update,
        "end": client.end_weight_update,
        "continue": client.continue_generation,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    samples = {stack: {} for stack in STACKS}
    with tempfile.TemporaryDirectory(prefix="control-plane-") as work:
        model_dir = write_model_dir(layout_config("tiny_dense"), Path(work))
        engines = {stack: Engines(model_dir, [EngineSpec(stack, 1, 0)], args.device == "cuda",
                                  Path(work), extra_argv=("--reference-http-stack", stack))
                   for stack in STACKS}
        try:
            calls = {stack: _calls(EngineClient(e.urls[0])) for stack, e in engines.items()}
            for stack in STACKS:
                samples[stack] = {name: [] for name in calls[stack]}
            for i in range(args.repeats + WARMUP_CYCLES):
                for stack in STACKS:
                    for name, fn in calls[stack].items():
                        t0 = time.perf_counter()
                        fn()
                        if i >= WARMUP_CYCLES:
                            samples[stack][name].append(time.perf_counter() - t0)
        finally:
            for e in engines.values():
                e.stop()
    record: dict = {"bench": "control_plane", "engine_device": args.device,
                    "repeats": args.repeats}
    for stack in STACKS:
        record[stack] = {name: latency_ms(xs) for name, xs in samples[stack].items()}
    record["ratio_auto_to_asyncio"] = {
        name: round(record["auto"][name]["median_ms"] / record["asyncio"][name]["median_ms"], 3)
        for name in samples["auto"]}
    emit(record, args.json_out)
    print(f"{'call':<12}{'auto ms':>10}{'asyncio ms':>12}{'ratio':>8}")
    for name, ratio in record["ratio_auto_to_asyncio"].items():
        print(f"{name:<12}{record['auto'][name]['median_ms']:>10.3f}"
              f"{record['asyncio'][name]['median_ms']:>12.3f}{ratio:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
