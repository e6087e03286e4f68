"""From one engine actor's placement and the job's flags to its EngineConfig and argv.

The only bridge between placement (`cluster/`) and engine launch: the run-time path
(`Fleet` -> `EngineActor`) and the offline checks (`--dry-run`, the config and
contract tests) compose server args through the same `EngineServer.compose_args`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slime_like.cluster.hosts import format_host
from slime_like.config.fleet_slices import EngineSettings
from slime_like.config.layout import EnginePlacement
from slime_like.engine.launch import render_argv
from slime_like.engine.server import EngineConfig, EngineServer
from slime_like.errors import ConfigError
from slime_like.protocol.flag_tables import ComposedArgs
from slime_like.protocol.modes import WorkerType
from slime_like.reference_engine.served_log import SERVED_LOG_ENV
from slime_like.reference_engine.step_floor import MIN_STEP_ENV


def _size(name: str, overrides: Mapping[str, Any], flags: Mapping[str, Any]) -> int:
    value = overrides.get(name, flags.get(name))
    return 1 if value is None else int(value)


def engine_config(engine: EnginePlacement, settings: EngineSettings, *,
                  model_path: str | None = None, log_dir: str | None = None) -> EngineConfig:
    """What the engine actor of `engine` is started with.

    `model_path` replaces the placement's (e.g. the tiny model the job made for the
    reference engine).
    """
    path = model_path or engine.model_path
    if not path:
        raise ConfigError("--hf-checkpoint", f"engine {engine.engine_id} has no model to load")
    flags, overrides = settings.sglang_flags, dict(engine.overrides)
    name = engine.engine_id.replace("/", "-") + (
        f"-node{engine.node_rank}" if engine.nnodes > 1 else "")
    env = {MIN_STEP_ENV: str(settings.reference_min_step_ms)} \
        if settings.reference_min_step_ms else {}
    if settings.program == "reference" and log_dir:
        # what it served at which version, beside its log (reference_engine/served_log.py)
        env[SERVED_LOG_ENV] = f"{log_dir}/{name}.served.jsonl"
    return EngineConfig(
        model_path=path, program=settings.program, worker_type=engine.worker_type,
        num_gpus_per_engine=engine.num_gpus, pp_size=_size("pp_size", overrides, flags),
        dp_size=_size("dp_size", overrides, flags), ep_size=_size("ep_size", overrides, flags),
        nnodes=engine.nnodes, node_rank=engine.node_rank, base_gpu_id=engine.base_gpu_id,
        engine_rank=engine.engine_index, seed=settings.seed,
        # Only engines on the trainer's GPUs give their memory back (slime's needs_offload).
        enable_memory_saver=bool(settings.offload_rollout and engine.shares_trainer_gpus),
        api_key=settings.api_key, admin_api_key=settings.admin_api_key,
        sglang_flags=dict(flags), overrides=overrides,
        overrides_path=f"{engine.group_where}.overrides", log_dir=log_dir,
        env=env, name=name)


def engine_server_args(engine: EnginePlacement, settings: EngineSettings, *, port: int,
                       nccl_port: int | None = None, dist_init_port: int | None = None,
                       bootstrap_port: int | None = None,
                       model_path: str | None = None) -> ComposedArgs:
    """The composed server args of one engine actor, for ports its actor would reserve."""
    if engine.nnodes > 1 and dist_init_port is None:
        raise ConfigError("dist_init_port", f"engine {engine.engine_id} spans {engine.nnodes} "
                                            "nodes and needs the port its node_rank 0 reserved")
    e = EngineServer(engine_config(engine, settings, model_path=model_path))
    if engine.dist_init_host and dist_init_port is not None:
        e.dist_init_addr = f"{format_host(engine.dist_init_host)}:{dist_init_port}"
    prefill = engine.worker_type == WorkerType.PREFILL
    return e.compose_args(host=engine.node_ip, port=port, nccl_port=nccl_port,
                          bootstrap_port=bootstrap_port if prefill else None)


def engine_argv(engine: EnginePlacement, settings: EngineSettings, **kw: Any) -> list[str]:
    """The command line of one engine actor's server, for `--engine sglang|reference`."""
    return render_argv(engine_server_args(engine, settings, **kw).args, settings.program)
