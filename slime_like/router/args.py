"""sglang-router launch arguments: our defaults, `--router-*` pass-through, the argv.

Defaults that differ from sglang-router 0.3.2's own, and why:

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
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from functools import cache
from typing import Any

from slime_like.cluster.hosts import format_host
from slime_like.errors import ConfigError
from slime_like.flag_tables import ROUTER_ARGS, ArgTable, ComposedArgs, load_arg_table, render_flags

ROUTER_DEFAULTS: dict[str, Any] = {
    "log_level": "warn",
    "balance_abs_threshold": 10,
    "balance_rel_threshold": 1.2,
    "request_timeout_secs": 14400,
    "disable_health_check": True,
}
PD_DEFAULTS: dict[str, Any] = {"disable_circuit_breaker": True}

# Set by Router itself from the ports it reserved; a flag may not move them.
_FORCED = ("host", "port", "prometheus_host", "prometheus_port", "pd_disaggregation")


@cache
def router_arg_table() -> ArgTable:
    """sglang-router's launcher flags, loaded once from the packaged table."""
    return load_arg_table(ROUTER_ARGS)


def compose_router_args(
    *,
    host: str,
    port: int,
    prometheus_port: int,
    pd_disaggregation: bool = False,
    router_flags: Mapping[str, Any] | None = None,
    prometheus_host: str | None = None,
) -> ComposedArgs:
    """Our defaults < `--router-<flag>` values (by field name, `router_` prefix optional);
    host/ports/PD mode are ours. Unknown fields are dropped with one warning."""
    table = router_arg_table()
    args: dict[str, Any] = dict(ROUTER_DEFAULTS)
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
        warnings.append(f"dropped {len(dropped)} router flag(s) that sglang-router "
                        f"{table.version} does not have: {', '.join(dropped)}")
    # sglang-router 0.3.2 parses its bind addresses as socket addresses: an IPv6 host must
    # come bracketed ("[::1]"); bare "::1" makes it exit with "invalid socket address syntax".
    args.update(host=format_host(host), port=int(port),
                prometheus_host=format_host(prometheus_host or host),
                prometheus_port=int(prometheus_port), pd_disaggregation=pd_disaggregation)
    return ComposedArgs(args=args, dropped=dropped, warnings=warnings)


def render_router_argv(args: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """`python -m slime_like.router.launch ...` (sglang-router's launcher without importing
    sglang) for composed router args."""
    table = router_arg_table()
    unknown = [k for k in args if k not in table]
    if unknown:
        raise ConfigError(unknown[0], f"not a flag of sglang-router {table.version}")
    return [python, "-m", "slime_like.router.launch", *render_flags(table, args)]
