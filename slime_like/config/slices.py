"""Typed slices of the job's configuration, built once from the parsed flags.

Each component takes its own slice (torchtitan style) instead of the whole argparse
namespace, so what a component depends on is visible in its signature, and the public
API (`slime_like.api`) can build the same slices without our command line.
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineSettings:
    """How every engine server is started (program, pass-through flags, keys)."""

    program: str = "reference"
    sglang_flags: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    offload_rollout: bool = False
    api_key: str | None = None
    admin_api_key: str | None = None
    server_concurrency: int = 512


@dataclass(frozen=True)
class RouterSettings:
    """How each model's sglang-router is started and called."""

    flags: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 300.0


@dataclass(frozen=True)
class HealthSettings:
    """Engine probing; `enabled` off collapses the monitor to nothing."""

    enabled: bool = True
    interval_s: float = 30.0
    timeout_s: float = 30.0
    first_wait_s: float = 300.0
    failure_threshold: int = 3


@dataclass(frozen=True)
class SyncSettings:
    """The trainer's weight sync (WeightSyncConfig's fields, from the job's flags)."""

    transport: str = "distributed"
    pause_mode: str = "retract"
    update_weight_buffer_size: int = 512 << 20
    disk_dir: str | None = None
    model_dir: str | None = None
    http_timeout_s: float = 120.0
    group_timeout_s: float = 120.0

    def weight_sync_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `WeightSyncConfig` (the fleet settles failures itself)."""
        return {"transport": self.transport, "pause_mode": self.pause_mode,
                "update_weight_buffer_size": self.update_weight_buffer_size,
                "disk_dir": self.disk_dir, "model_dir": self.model_dir,
                "http_timeout_s": self.http_timeout_s, "group_timeout_s": self.group_timeout_s,
                "resume_on_failure": False}


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
    api = args.sglang_flags.get("api_key") or secrets.token_hex(24)
    admin = args.sglang_flags.get("admin_api_key") or secrets.token_hex(24)
    router = args.router_flags.get("api_key") or api
    return api, admin, router


def engine_settings(args: argparse.Namespace, *, api_key: str | None = None,
                    admin_api_key: str | None = None) -> EngineSettings:
    flags = {k: v for k, v in args.sglang_flags.items() if k not in ("api_key", "admin_api_key")}
    return EngineSettings(program=args.engine, sglang_flags=flags, seed=args.seed,
                          offload_rollout=bool(args.offload_rollout),
                          api_key=api_key if api_key is not None else args.sglang_flags.get("api_key"),
                          admin_api_key=admin_api_key if admin_api_key is not None
                          else args.sglang_flags.get("admin_api_key"),
                          server_concurrency=args.sglang_server_concurrency)


def fleet_settings(args: argparse.Namespace, *, log_dir: str,
                   model_paths: dict[str, str] | None = None,
                   keys: tuple[str | None, str | None, str | None] | None = None) -> FleetSettings:
    """The fleet's slice of the job's flags."""
    api, admin, router_key = keys or (None, None, None)
    router_flags = {k: v for k, v in args.router_flags.items() if k != "api_key"}
    router_flags["request_timeout_secs"] = args.sglang_router_request_timeout_secs
    return FleetSettings(
        engine=engine_settings(args, api_key=api, admin_api_key=admin),
        router=RouterSettings(flags=router_flags,
                              api_key=router_key or args.router_flags.get("api_key"),
                              request_timeout_s=float(args.rollout_request_timeout)),
        health=HealthSettings(enabled=bool(args.use_fault_tolerance),
                              interval_s=args.rollout_health_check_interval,
                              timeout_s=args.rollout_health_check_timeout,
                              first_wait_s=args.rollout_health_check_first_wait,
                              failure_threshold=args.rollout_health_check_failures),
        log_dir=log_dir, model_paths=dict(model_paths or {}),
        external_addrs=tuple(args.rollout_external_engine_addrs or ()),
        external_wait_s=float(args.external_engine_reconnect_timeout),
        router_port=args.sglang_router_port)


def sync_settings(args: argparse.Namespace, model_dir: str) -> SyncSettings:
    """The trainer's weight-sync slice (`nccl` is slime's name: IPC colocated, else a group)."""
    transport = args.update_weight_transport
    if transport == "nccl":
        transport = "tensor" if args.colocate else "distributed"
    # A hung engine holds a sync no longer than a hung request holds a rollout.
    timeout = min(120.0, float(args.rollout_request_timeout))
    return SyncSettings(transport=transport, pause_mode=args.pause_mode,
                        update_weight_buffer_size=args.update_weight_buffer_size,
                        disk_dir=args.update_weight_disk_dir, model_dir=model_dir,
                        http_timeout_s=timeout, group_timeout_s=timeout)
