"""sglang 0.5.23's own `/v1/loads` entry shape, from its `LoadSnapshot`, in a child process.

`python -m tests.contract.sglang_loads INCLUDE...` prints, as JSON, for each `include`
value ("-" for none), the keys and JSON types of `LoadSnapshot.to_dict(include)` for a
snapshot with every section filled in, or the error sglang raises for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from slime_like.errors import LaunchError


def json_type(value: Any) -> Any:
    """A value's JSON type, sections by key ({"key": "int", ...})."""
    if isinstance(value, dict):
        return {k: json_type(v) for k, v in value.items()}
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list",
            type(None): "null"}[type(value)]


def sglang_load_shapes(includes: list[str | None], timeout: float = 180.0) -> dict[str, Any]:
    """{include or "-": {key: type} or {"error": text}} from sglang's own code."""
    proc = subprocess.run([sys.executable, "-m", "tests.contract.sglang_loads",
                           *[i or "-" for i in includes]], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise LaunchError("sglang /v1/loads shape subprocess failed", proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(includes: list[str]) -> None:
    from sglang.srt.managers import load_snapshot as ls

    snapshot = ls.LoadSnapshot(
        timestamp=1.5, dp_rank=0, num_running_reqs=1, num_waiting_reqs=2,
        num_waiting_uncached_tokens=3, num_used_tokens=4, num_total_tokens=5,
        num_active_tokens=6, num_prealloc_ready_tokens=7, max_total_num_tokens=8,
        max_running_requests=9, token_usage=0.5, gen_throughput=1.5, cache_hit_rate=0.5,
        utilization=0.5, total_prefill_uncached_tokens=10, total_prefill_busy_us=11,
        memory=ls.MemoryMetrics(weight_gb=1.0, kv_cache_gb=1.0, graph_gb=0.0, token_capacity=8),
        speculative=ls.SpeculativeMetrics(accept_length=1.0, accept_rate=0.5),
        lora=ls.LoRAMetrics(slots_used=0, slots_total=1, utilization=0.0),
        disaggregation=ls.DisaggregationMetrics(mode="null"),
        queues=ls.QueueMetrics(waiting=2, grammar=0, paused=0, retracted=0, prealloc_ready=0))
    out: dict[str, Any] = {}
    for text in includes:
        include = None if text == "-" else {x.strip() for x in text.split(",")}
        try:
            out[text] = json_type(snapshot.to_dict(include))
        except ValueError as e:
            out[text] = {"error": str(e)}
    print(json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1:])
