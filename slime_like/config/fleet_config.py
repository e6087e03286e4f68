"""The fleet of `slime_like.api.launch_fleet`, from settings objects instead of flags.

A trainer of one's own says what it wants as the same typed slices the job builds from its
flags (`EngineSettings`, `RouterSettings`, `HealthSettings`, plus `FleetLayout` for what a
`--sglang-config` does not say), and gets the same checks: the topology (`topology_of`),
the router's flags (`check_router_flags`), external addresses, and placement dry-run on
nominal nodes, so a misaligned group fails before any GPU is held. Nothing here renders or
parses a command line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from slime_like.config.flags import ENGINE_PROGRAMS
from slime_like.config.fleet_slices import (
    DEFAULT_ROUTER_REQUEST_TIMEOUT_SECS,
    EngineSettings,
    FleetSettings,
    HealthSettings,
    RouterSettings,
    fresh_keys,
    rl_plane_on,
)
from slime_like.config.layout import nominal_bundles, placement_group_layout, plan_job
from slime_like.config.passthrough import OWNED_ROUTER_FIELDS, SLIME_ROUTER_DEFAULTS
from slime_like.config.slices import PlacementSettings
from slime_like.config.topology import TopologyInputs, topology_of
from slime_like.config.validate import check_addresses, check_router_flags
from slime_like.errors import ConfigError

logger = logging.getLogger(__name__)

KEY_FIELDS = ("api_key", "admin_api_key")
# The API sets the router's request timeout as a flag like any other (the job has its own).
API_OWNED_ROUTER_FIELDS = {k: v for k, v in OWNED_ROUTER_FIELDS.items()
                           if k != "request_timeout_secs"}


@dataclass(frozen=True)
class FleetLayout:
    """What a `--sglang-config` does not say: engines without one, the cluster's node size,
    engines someone else runs."""

    num_gpus: int | None = None            # without a YAML: GPUs of all engines (with one: its sum)
    gpus_per_engine: int = 1               # without a YAML: GPUs of each engine
    gpus_per_node: int = 8                 # engines larger than this span nodes
    external_addrs: tuple[str, ...] = ()   # HOST:PORT of engines to attach (never launched/killed)
    external_wait_s: float = FleetSettings.external_wait_s  # a dead external engine's return
    router_port: int | None = None         # a fixed port for the updatable model's router


def fleet_config(sglang_config: str | Path | None, *, model_path: str, log_dir: str,
                 engine: EngineSettings, router: RouterSettings, health: HealthSettings,
                 layout: FleetLayout) -> tuple[PlacementSettings, FleetSettings]:
    """The placement and fleet slices of a fleet of engines only (no trainer slots); keys
    not given are fresh. Raises ConfigError naming the YAML path, the setting or the flag
    that says the same."""
    external = tuple(layout.external_addrs)
    _check(sglang_config, engine, health, external)
    check_router_flags(router.kind, router.flags, owned=API_OWNED_ROUTER_FIELDS)
    inputs = TopologyInputs(hf_checkpoint=model_path, rollout_num_gpus=layout.num_gpus,
                            rollout_num_gpus_per_engine=layout.gpus_per_engine,
                            num_gpus_per_node=layout.gpus_per_node,
                            sglang_pp_size=engine.sglang_flags.get("pp_size"),
                            engine=engine.program)
    topology = topology_of(inputs, sglang_config=sglang_config, external=bool(external))
    for warning in topology.warnings:
        logger.warning("%s", warning)
    if topology.num_gpus == 0 and not external:
        raise ConfigError("layout.num_gpus", "0 leaves the fleet without engines; give "
                                             "a --sglang-config, GPUs or external_addrs")
    group_layout = placement_group_layout(actor_gpus=0, rollout_gpus=topology.num_gpus,
                                          debug_rollout_only=True, rollout_external=bool(external))
    # Dry run on nominal nodes: a misaligned group fails before any GPU is held.
    plan_job(topology, nominal_bundles(group_layout.num_bundles, layout.gpus_per_node),
             group_layout)

    flags = dict(engine.sglang_flags)
    given = {k: flags.pop(k, None) for k in KEY_FIELDS}
    router_flags = {**SLIME_ROUTER_DEFAULTS,
                    "request_timeout_secs": DEFAULT_ROUTER_REQUEST_TIMEOUT_SECS, **router.flags}
    api, admin, router_key = fresh_keys(engine.api_key or given["api_key"],
                                        engine.admin_api_key or given["admin_api_key"],
                                        router.api_key or router_flags.pop("api_key", None),
                                        rl_plane=rl_plane_on(router.kind, router_flags))
    fleet = FleetSettings(
        engine=replace(engine, sglang_flags=flags, api_key=api, admin_api_key=admin),
        router=replace(router, flags={k: v for k, v in router_flags.items() if v is not None},
                       api_key=router_key),
        health=health, log_dir=log_dir,
        model_paths={m.name: model_path for m in topology.models if m.update_weights},
        external_addrs=external, external_wait_s=float(layout.external_wait_s),
        router_port=layout.router_port)
    return PlacementSettings(topology=topology, layout=group_layout), fleet


def _check(sglang_config: str | Path | None, engine: EngineSettings, health: HealthSettings,
           external: tuple[str, ...]) -> None:
    """The job's cross-flag rules that a fleet of engines only can break."""
    if engine.program not in ENGINE_PROGRAMS:
        raise ConfigError("engine.program", f"expected one of {list(ENGINE_PROGRAMS)}, got "
                                            f"{engine.program!r}")
    if engine.reference_min_step_ms and engine.program != "reference":
        raise ConfigError("engine.reference_min_step_ms", "only the reference engine has it "
                                                          f"(program is {engine.program})")
    check_addresses(external)
    if external and sglang_config is not None:
        raise ConfigError("layout.external_addrs", "cannot be combined with a --sglang-config "
                                                   "(external engines are not placed)")
    if external and not health.enabled:
        raise ConfigError("layout.external_addrs", "needs HealthSettings(enabled=True) (no "
                                                   "process of ours reports an external "
                                                   "engine's death: only probes see it)")
