"""`GET /v1/loads` in sglang 0.5.23's shape: one `LoadSnapshot.to_dict` per DP rank.

Routers read it to balance load (smg's `least_load`, `power_of_two` and overload
protection poll `/v1/loads?include=core,disagg,queues,memory`), and so does our own
utilization sampler. sglang returns every core key of its snapshot, then the sections
asked for in `include` (`None` or `all`: every section it has; `core` alone: none);
`memory`, `disaggregation` and `queues` are always there to give (speculative and LoRA
sections only with those features, which the reference engine does not have).
`tests/reference_engine/test_info_endpoints.py` checks these keys and types against sglang's own
`LoadSnapshot`.

Reference-engine additions (read by `observe/utilization.py` and the tests; sglang has no
such keys, so nothing may depend on them against a real engine): the core keys in
`EXTENSIONS`, and `memory.kv_cache_bytes`.
"""

from __future__ import annotations

import time
from typing import Any

# include name -> the section's key in each load entry (sglang's LoadSnapshot.to_dict)
SECTIONS = {"memory": "memory", "spec": "speculative", "lora": "lora",
            "disagg": "disaggregation", "queues": "queues"}
VALID_INCLUDE = frozenset({"core", "all", *SECTIONS})
#: ours from the scheduler's counters; `paused` is the pause gate's (the frontend's)
SCHEDULER_EXTENSIONS = ("num_cached_tokens", "num_retracted_reqs")
EXTENSIONS = (*SCHEDULER_EXTENSIONS, "paused")
MEMORY_EXTENSIONS = ("kv_cache_bytes",)


def parse_include(text: str | None) -> set[str] | None:
    """`include=a,b` as a set (None: everything); ValueError for a section sglang lacks."""
    if text is None:
        return None
    parts = {x.strip() for x in text.split(",")}
    if not parts <= VALID_INCLUDE:
        raise ValueError(f"Invalid include sections: {parts - VALID_INCLUDE}. "
                         f"Valid options: {sorted(VALID_INCLUDE)}")
    return parts


def load_entry(load: dict[str, Any], *, disaggregation_mode: str, weight_bytes: int,
               kv_cache_bytes: int, paused: bool) -> dict[str, Any]:
    """Every key of one DP rank's entry (all sections), from the scheduler's counters."""
    gb = 1024 ** 3
    core = {
        "timestamp": time.time(), "dp_rank": 0,
        "num_running_reqs": load["num_running_reqs"],
        "num_waiting_reqs": load["num_waiting_reqs"],
        "num_waiting_uncached_tokens": load["num_waiting_uncached_tokens"],
        "num_used_tokens": load["num_used_tokens"],
        "num_total_tokens": load["num_total_tokens"],
        "num_active_tokens": load["num_active_tokens"],
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": load["max_total_num_tokens"],
        "max_running_requests": load["max_running_requests"],
        "token_usage": round(float(load["token_usage"]), 4),
        "gen_throughput": round(float(load["gen_throughput"]), 2),
        "cache_hit_rate": round(float(load["cache_hit_rate"]), 4),
        "utilization": round(float(load["token_usage"]), 4),
        # cumulative prefill counters and decode step-time moments: not measured here;
        # sglang reports 0 / null until it has some
        "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0, "decode_moments": None,
        **{k: load[k] for k in SCHEDULER_EXTENSIONS},
        # The gate's state, which a pause or continue sets before it answers: the
        # scheduler applies a continue after the answer (as in sglang), and a read sent
        # after it must not see the engine still paused (sglang's read queues behind it).
        "paused": paused,
    }
    waiting = load["num_waiting_reqs"]
    return {
        **core,
        "memory": {"weight_gb": round(weight_bytes / gb, 3),
                   "kv_cache_gb": round(kv_cache_bytes / gb, 3), "graph_gb": 0.0,
                   "token_capacity": int(load["max_total_num_tokens"]),
                   "kv_cache_bytes": kv_cache_bytes},
        "disaggregation": {"mode": disaggregation_mode, "prefill_bootstrap_queue_reqs": 0,
                           "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                           "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                           "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
        "queues": {"waiting": waiting, "grammar": 0, "paused": waiting if paused else 0,
                   "retracted": load["num_retracted_reqs"], "prealloc_ready": 0},
    }


def select(entry: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    """The entry as sglang answers `include`: core keys, plus the sections asked for."""
    if include is None or "all" in include:
        return entry
    keep = {SECTIONS[name] for name in include if name in SECTIONS}
    section_keys = set(SECTIONS.values())
    return {k: v for k, v in entry.items() if k not in section_keys or k in keep}


def prometheus_text(entries: list[dict[str, Any]]) -> str:
    """`format=prometheus`: one gauge per numeric key, sections as `sglang_<section>_<key>`
    (`spec`/`disagg` for the speculative and disaggregation sections), as sglang writes them."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, Any]]] = {}

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    for entry in entries:
        rank = entry["dp_rank"]
        for key, value in entry.items():
            if key == "dp_rank":
                continue
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub, v in value.items():
                    if number(v):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, v))
            elif number(value):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {v}' for rank, v in values]
    return "\n".join(lines) + "\n"
