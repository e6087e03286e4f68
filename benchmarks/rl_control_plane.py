"""A sync's fan-out calls through smg's RL control plane (`--enable-rl`, `/v1/rl/engine/*`)
against the engine sessions' own fan-out, side by side on the same engines.

N reference engines (plain processes, each with a user key and a separate admin key, as
the fleet starts them) are registered with one smg 1.13 started with `--enable-rl`. Each
cycle is what a sync asks of every engine around its transfer: pause (retract), then
continue; once through the sessions (`engine/fanout.on_all`: one call per engine from this
process, on the engine-call pool, the admin key on each) and once through smg (one
`POST /v1/rl/engine/<call>?selector=...` per step; smg calls every matching worker and
answers each one's status). The two alternate cycle by cycle, so both see the same
machine. Prints one JSON line: the median and p90 milliseconds of a cycle each way, their
ratio (smg / sessions), the CPU this process spent per cycle each way (the sessions'
fan-out costs the driver CPU per engine; smg's costs it one call), and what each engine
answered smg (its HTTP status per call: the
worker is registered with the key smg sends it, so whether an engine's admin routes let
smg in depends on which key it was registered with; `--register-with` picks it).

    python benchmarks/rl_control_plane.py --engines 8                    # the fleet's keys
    python benchmarks/rl_control_plane.py --engines 16 --engine-keys one  # smg can pause them
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.records import emit, latency_ms  # noqa: E402
from benchmarks.weight_sync import Engines, EngineSpec, layout_config, write_model_dir  # noqa: E402
from slime_like.engine.address import EngineAddress  # noqa: E402
from slime_like.engine.fanout import on_all  # noqa: E402
from slime_like.engine.session import EngineSession  # noqa: E402
from slime_like.protocol.modes import PauseMode  # noqa: E402
from slime_like.router.kinds import SMG  # noqa: E402
from slime_like.router.router import Router  # noqa: E402

USER_KEY, ADMIN_KEY, ROUTER_KEY = "user-key", "admin-key", "router-key"
WARMUP_CYCLES = 5


class RlFanout:
    """One step to every worker through smg's `/v1/rl/engine/<path>` (one keep-alive
    connection); each worker's HTTP status, by URL."""

    def __init__(self, router_url: str, selector: str, key: str):
        self.url = router_url
        self.selector = selector
        self.http = requests.Session()
        self.http.trust_env = False
        self.http.headers["Authorization"] = f"Bearer {key}"

    def call(self, path: str, body: dict) -> dict[str, int | str]:
        resp = self.http.post(f"{self.url}/v1/rl/engine/{path}", json=body,
                              params={"selector": self.selector}, timeout=60)
        out = resp.json() if resp.headers.get("content-type", "").startswith(
            "application/json") else {"error": resp.text[:300]}
        if "results" not in out:
            raise RuntimeError(f"smg /v1/rl/engine/{path}: HTTP {resp.status_code}: {out}")
        statuses: dict[str, int | str] = {r["url"]: r["status"]
                                          for r in out["results"].values()}
        for f in out.get("failed") or []:
            statuses[f.get("url", "?")] = f"{f.get('status')} {f.get('error')}"
        return statuses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--register-with", choices=["user", "admin"], default="user",
                    help="the key each worker is registered with (smg sends it on every "
                         "call to the worker, generation and control alike)")
    ap.add_argument("--router-key", choices=["own", "admin"], default="own",
                    help="smg's own API key, or the engines' admin key (to see whether smg "
                         "passes the caller's key on to the engines)")
    ap.add_argument("--engine-keys", choices=["separate", "one"], default="separate",
                    help="separate: a user and an admin key (the fleet's default); one: the "
                         "user key only, which then opens the admin routes too")
    ap.add_argument("--selector", default="engine=sglang",
                    help="which workers a fan-out reaches (smg's label selector)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    admin_key = ADMIN_KEY if args.engine_keys == "separate" else None
    registered_key = USER_KEY if args.register_with == "user" else admin_key or USER_KEY
    router_key = ROUTER_KEY if args.router_key == "own" else ADMIN_KEY
    with tempfile.TemporaryDirectory(prefix="rl-control-plane-") as work:
        model_dir = write_model_dir(layout_config("tiny_dense"), Path(work))
        specs = [EngineSpec(f"E{i}", 1, 0) for i in range(args.engines)]
        engines = Engines(model_dir, specs, False, Path(work),
                          extra_argv=("--api-key", USER_KEY,
                                      *(("--admin-api-key", admin_key) if admin_key else ())))
        router = Router(kind=SMG, router_flags={"enable_rl": True, "policy": "round_robin"},
                        api_key=router_key, log_dir=work, name="smg-rl")
        try:
            router.start()
            client = router.client
            for url in engines.urls:
                client.add_worker(url, api_key=registered_key, timeout=60)
            sessions = [EngineSession(EngineAddress(url, api_key=USER_KEY,
                                                    admin_api_key=admin_key))
                        for url in engines.urls]
            rl = RlFanout(router.url, args.selector, router_key)
            first_pause = rl.call("pause_generation", {"mode": PauseMode.RETRACT})
            first_continue = rl.call("continue_generation", {})
            reached = len(first_pause)
            ok = all(s == 200 for s in [*first_pause.values(), *first_continue.values()])
            times: dict[str, list[float]] = {"sessions": [], "smg_rl": []}
            cpu = {"sessions": 0.0, "smg_rl": 0.0}  # this process's CPU seconds
            for i in range(args.repeats + WARMUP_CYCLES):
                t0, c0 = time.perf_counter(), time.process_time()
                on_all(sessions, "pause", lambda s: s.pause_generation(PauseMode.RETRACT))
                on_all(sessions, "continue", lambda s: s.continue_generation())
                t1, c1 = time.perf_counter(), time.process_time()
                rl.call("pause_generation", {"mode": PauseMode.RETRACT})
                rl.call("continue_generation", {})
                t2, c2 = time.perf_counter(), time.process_time()
                if i >= WARMUP_CYCLES:
                    times["sessions"].append(t1 - t0)
                    times["smg_rl"].append(t2 - t1)
                    cpu["sessions"] += c1 - c0
                    cpu["smg_rl"] += c2 - c1
            for s in sessions:
                s.undo()
        finally:
            router.stop()
            engines.stop()
    record = {"bench": "rl_control_plane", "engines": args.engines, "repeats": args.repeats,
              "router": f"smg {router.version}", "registered_with": args.register_with,
              "router_key": args.router_key, "engine_keys": args.engine_keys,
              "workers_reached": reached, "all_answered_200": ok,
              "first_pause_statuses": sorted({str(v) for v in first_pause.values()}),
              **{k: latency_ms(v, 3) for k, v in times.items()},
              # what the caller's process spends per cycle (the sessions' fan-out runs in
              # the driver, under its GIL; smg's in the router)
              "caller_cpu_ms_per_cycle": {k: round(v / args.repeats * 1e3, 3)
                                          for k, v in cpu.items()}}
    record["ratio_smg_to_sessions"] = round(record["smg_rl"]["median_ms"]
                                            / record["sessions"]["median_ms"], 3)
    emit(record, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
