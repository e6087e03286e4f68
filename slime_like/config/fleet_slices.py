"""The fleet's typed slices: how engines, routers and the health monitor are configured.

Built from the job's flags here (`fleet_settings`), or directly by the public API
(`slime_like.api.launch_fleet`), so both start the same fleet. The job's own slices
(placement, rollout, trainer, ...) are in `config/slices.py`.
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass, field
from typing import Any

from slime_like.config.deadlines import DeadlinePolicy
from slime_like.errors import ConfigError
from slime_like.protocol.flag_tables import DEFAULT_ROUTER
from slime_like.protocol.modes import Dispatch

# The defaults below are the flags' defaults too (`flags.py` reads them from here), so the
# job and `slime_like.api.launch_fleet` start the same fleet unless told otherwise.
DEFAULT_ROUTER_REQUEST_TIMEOUT_SECS = 14400  # slime's --sglang-router-request-timeout-secs


@dataclass(frozen=True)
class EngineSettings:
    """How every engine server is started: `program` "sglang" or "reference", sglang's
    ServerArgs fields by name (`{"mem_fraction_static": 0.7}`), the seed, keys (None: fresh
    ones per run)."""

    program: str = "sglang"
    sglang_flags: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    offload_rollout: bool = False
    api_key: str | None = None
    admin_api_key: str | None = None
    server_concurrency: int = 512
    reference_min_step_ms: float = 0.0  # the reference engine's step floor (its environment)


@dataclass(frozen=True)
class RouterSettings:
    """How each model's router is started and called: `kind` "sglang-router" or "smg", its
    flags by field name (`{"policy": "round_robin"}`), the key (None: the engines' API key),
    how long one /generate through it may take, and whether it or the rollout client binds
    each request to an engine (`dispatch`)."""

    kind: str = DEFAULT_ROUTER
    flags: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 600.0
    #: who binds a rollout request to an engine: the router's policy, or the client's
    #: admission (a routed engine's free slot; rollout/dispatch.py)
    dispatch: Dispatch = Dispatch.ROUTER
    #: admission: requests bound to an engine beyond its slots, waiting in its own queue so
    #: a freed slot is refilled at its next step instead of after a round trip (0: never
    #: beyond its slots; docs/ASYNC.md says when a queue wins and when it loses)
    dispatch_queue: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatch", Dispatch(self.dispatch))
        if self.dispatch_queue < 0:
            raise ValueError(f"RouterSettings.dispatch_queue must be >= 0, "
                             f"got {self.dispatch_queue}")


@dataclass(frozen=True)
class HealthSettings:
    """Engine probing (`--use-fault-tolerance`); off, the monitor is nothing and no engine
    is probed. A probe unanswered past its deadline (`deadlines`: derived from what the
    engines' probes took lately, at most `timeout_s`) already makes its engine SUSPECT: out
    of the router, its requests in flight resubmitted; a death still takes
    `failure_threshold` probes that fail or time out."""

    enabled: bool = False
    interval_s: float = 30.0
    timeout_s: float = 30.0
    first_wait_s: float = 300.0
    failure_threshold: int = 3
    deadlines: DeadlinePolicy = field(default_factory=DeadlinePolicy)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadlines", DeadlinePolicy.of(self.deadlines))


@dataclass(frozen=True)
class FleetSettings:
    """What the fleet needs: engines, routers, health, where logs go, what to load."""

    engine: EngineSettings
    router: RouterSettings
    health: HealthSettings
    log_dir: str
    model_paths: dict[str, str] = field(default_factory=dict)  # model name -> path override
    external_addrs: tuple[str, ...] = ()   # engines someone else runs (never launched/killed)
    external_wait_s: float = 300.0         # how long a dead external engine may take to return
    router_port: int | None = None         # fixed port of the updatable model's router
    register_timeout_s: float = 60.0
    verify_timeout_s: float = 5.0


def make_keys(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """(api key, admin key, router key): the user's, or fresh ones per run.

    Keys are on by default: every engine and router of the run gets them, and every client
    the job creates uses them, so nothing else on the network can pause, update or route.
    """
    return fresh_keys(args.sglang_flags.get("api_key"), args.sglang_flags.get("admin_api_key"),
                      args.router_flags.get("api_key"),
                      rl_plane=rl_plane_on(getattr(args, "router", None), args.router_flags))


def rl_plane_on(router: str | None, router_flags: dict[str, Any]) -> bool:
    """Whether syncs reach the engines through smg's RL control plane (`--router smg
    --router-enable-rl`)."""
    return (router or DEFAULT_ROUTER) == "smg" and bool(router_flags.get("enable_rl"))


def fresh_keys(api: str | None, admin: str | None, router: str | None, *,
               rl_plane: bool = False) -> tuple[str | None, str, str]:
    """Each key given, or a fresh one; the router's defaults to the engines' API key.

    `rl_plane`: the engines get no user key (smg calls a worker with the one key it was
    registered with, and must reach both its info and its admin routes: it is registered
    with the admin key), and the router its own key, which guards the users."""
    if rl_plane:
        if api:
            raise ConfigError("--sglang-api-key", "with --router smg --router-enable-rl the "
                              "engines run with the admin key only (smg reaches them with "
                              "it); the router's key (--router-api-key) guards the users")
        return None, admin or secrets.token_hex(24), router or secrets.token_hex(24)
    api = api or secrets.token_hex(24)
    return api, admin or secrets.token_hex(24), router or api


def engine_settings(args: argparse.Namespace, *, api_key: str | None = None,
                    admin_api_key: str | None = None) -> EngineSettings:
    flags = {k: v for k, v in args.sglang_flags.items() if k not in ("api_key", "admin_api_key")}
    return EngineSettings(program=args.engine, sglang_flags=flags, seed=args.seed,
                          offload_rollout=bool(args.offload_rollout),
                          api_key=api_key if api_key is not None else args.sglang_flags.get("api_key"),
                          admin_api_key=admin_api_key if admin_api_key is not None
                          else args.sglang_flags.get("admin_api_key"),
                          server_concurrency=args.sglang_server_concurrency,
                          reference_min_step_ms=args.reference_min_step_ms)


def fleet_settings(args: argparse.Namespace, *, log_dir: str,
                   model_paths: dict[str, str] | None = None,
                   keys: tuple[str | None, str | None, str | None] | None = None) -> FleetSettings:
    """The fleet's slice of the job's flags."""
    api, admin, router_key = keys or (None, None, None)
    router_flags = {k: v for k, v in args.router_flags.items() if k != "api_key"}
    router_flags["request_timeout_secs"] = args.sglang_router_request_timeout_secs
    return FleetSettings(
        engine=engine_settings(args, api_key=api, admin_api_key=admin),
        router=RouterSettings(kind=getattr(args, "router", None) or DEFAULT_ROUTER,
                              flags=router_flags,
                              api_key=router_key or args.router_flags.get("api_key"),
                              request_timeout_s=float(args.rollout_request_timeout),
                              dispatch=args.rollout_dispatch,
                              dispatch_queue=args.rollout_dispatch_queue),
        health=HealthSettings(enabled=bool(args.use_fault_tolerance),
                              interval_s=args.rollout_health_check_interval,
                              timeout_s=args.rollout_health_check_timeout,
                              first_wait_s=args.rollout_health_check_first_wait,
                              failure_threshold=args.rollout_health_check_failures),
        log_dir=log_dir, model_paths=dict(model_paths or {}),
        external_addrs=tuple(args.rollout_external_engine_addrs or ()),
        external_wait_s=float(args.external_engine_reconnect_timeout),
        router_port=args.sglang_router_port)
