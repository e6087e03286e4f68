"""Router launch arguments: our defaults, `--router-*` pass-through, the argv.

The same composition serves both routers (`kinds.py`); each checks the flags against its
own table. Defaults that differ from sglang-router 0.3.2's and smg 1.13's own, and why:

- `disable_health_check`: the router's checker GETs each worker's `/health`, which on a
  paused sglang queues a generation behind the pause and answers 503 after ~20 s; the
  router would then eject every engine in the middle of each weight update. The
  orchestrator probes engines itself (process exit, `/health_generate` with thresholds and
  a cold-start grace) and removes dead ones with `DELETE /workers/{id}`. Registration still
  waits for `/health` to answer 200 (the router's add-worker job probes it once).
- `disable_circuit_breaker` in PD mode only (as slime): a slow KV transfer fails requests
  on a healthy decode engine. In regular mode the breaker only counts failed proxied
  requests; a paused engine holds or aborts requests with 200, so it is never tripped by a
  pause, while a crashed engine stops getting traffic before our monitor removes it.
- slime's tuning: `log_level=warn`, `balance_abs_threshold=10`, `balance_rel_threshold=1.2`,
  `request_timeout_secs=14400` (long RL rollouts).
- smg only, `disable_tokenizer_autoload`: at each registration smg loads the tokenizer the
  worker names (`tokenizer_path` of its `/model_info`), which for a Hugging Face id means a
  download from the router's node; in HTTP mode it forwards text and token ids as they
  come and never tokenizes, so the load buys nothing.
- smg only, `load_monitor_interval=1` (smg: 10 s): its load-aware policies (`least_load`,
  `power_of_two`) and overload protection read each worker's `/v1/loads` at this interval;
  an RL rollout's load changes within a second, and one small GET per engine and second
  costs nothing.
- smg only, `disable_worker_overload_protection` (smg: on, at 8 waiting requests or 0.8 KV
  usage): it leaves an engine out of routing on a load read up to a poll old, so a
  rollout's burst goes to the others while that engine drains its queue and idles. The
  engines queue requests themselves. Measured with 4 reference engines, fully-async, on 2
  cores: `least_load` 16 samples/s with it, 42 without (docs/COMPATIBILITY.md).
- smg only, `shutdown_grace_period_secs=1` (smg: 180): smg waits for open connections on
  SIGTERM, 5 s even when idle; the job stops its routers only when nothing of it is in
  flight any more.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from slime_like.cluster.hosts import format_host
from slime_like.errors import ConfigError
from slime_like.protocol.flag_tables import ArgTable, ComposedArgs, render_flags, router_table
from slime_like.router.kinds import SMG, RouterKind, router_kind

ROUTER_DEFAULTS: dict[str, Any] = {
    "log_level": "warn",
    "balance_abs_threshold": 10,
    "balance_rel_threshold": 1.2,
    "request_timeout_secs": 14400,
    "disable_health_check": True,
}
PD_DEFAULTS: dict[str, Any] = {"disable_circuit_breaker": True}
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    SMG: {"disable_tokenizer_autoload": True, "load_monitor_interval": 1,
          "disable_worker_overload_protection": True, "shutdown_grace_period_secs": 1}}

# Set by Router itself from the ports it reserved; a flag may not move them.
_FORCED = ("host", "port", "prometheus_host", "prometheus_port", "pd_disaggregation")


def router_arg_table(kind: str | RouterKind | None = None) -> ArgTable:
    """A router's launcher flags (default: sglang-router's), loaded once from its table."""
    return router_table(router_kind(kind).name)


def compose_router_args(
    *,
    host: str,
    port: int,
    prometheus_port: int,
    pd_disaggregation: bool = False,
    router_flags: Mapping[str, Any] | None = None,
    prometheus_host: str | None = None,
    kind: str | RouterKind | None = None,
) -> ComposedArgs:
    """Our defaults < `--router-<flag>` values (by field name, `router_` prefix optional);
    host/ports/PD mode are ours. Fields the router does not have are dropped with one
    warning."""
    kind = router_kind(kind)
    table = router_arg_table(kind)
    args: dict[str, Any] = {**ROUTER_DEFAULTS, **KIND_DEFAULTS.get(kind.name, {})}
    if pd_disaggregation:
        args.update(PD_DEFAULTS)
    warnings: list[str] = []
    dropped: list[str] = []
    for key, value in (router_flags or {}).items():
        if value is None:
            continue
        name = key.replace("-", "_")
        if name.startswith("router_") and name not in table:
            name = name[len("router_"):]
        if name in _FORCED:
            raise ConfigError(f"--router-{name.replace('_', '-')}",
                              "is set by slime_like from the ports it reserved; not a flag here")
        if name not in table:
            dropped.append(name)
            continue
        spec = table[name]
        if spec.choices and value not in spec.choices:
            raise ConfigError(f"--router-{name.replace('_', '-')}",
                              f"{value!r} is not one of {list(spec.choices)}")
        args[name] = value
    if dropped:
        warnings.append(f"dropped {len(dropped)} router flag(s) that {kind.name} "
                        f"{table.version} does not have: {', '.join(dropped)}")
    # sglang-router 0.3.2 (and smg) parses its bind addresses as socket addresses: an IPv6 host must
    # come bracketed ("[::1]"); bare "::1" makes it exit with "invalid socket address syntax".
    args.update(host=format_host(host), port=int(port),
                prometheus_host=format_host(prometheus_host or host),
                prometheus_port=int(prometheus_port), pd_disaggregation=pd_disaggregation)
    return ComposedArgs(args=args, dropped=dropped, warnings=warnings)


def render_router_argv(args: Mapping[str, Any], python: str = sys.executable,
                       kind: str | RouterKind | None = None) -> list[str]:
    """`python -m <the router's own launcher> ...` for composed router args:
    `slime_like.router.launch` (sglang-router's launcher without importing sglang) or
    `smg.launch_router`; never the shared `smg` console script."""
    kind = router_kind(kind)
    table = router_arg_table(kind)
    unknown = [k for k in args if k not in table]
    if unknown:
        raise ConfigError(unknown[0], f"not a flag of {kind.name} {table.version}")
    return [python, "-m", kind.module, *render_flags(table, args)]
