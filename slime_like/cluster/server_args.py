"""From one engine actor's placement to its sglang server args and argv.

Glue between placement and `engine/launch.py`: the forced values come from the placement
(node, GPUs, node rank, engine size) and the ports its actor reserved; `--sglang-*` flags
and the group's overrides are layered on top by `compose_server_args`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from slime_like.cluster.layout import EnginePlacement
from slime_like.engine.launch import (
    ComposedArgs,
    compose_server_args,
    forced_server_args,
    render_argv,
)
from slime_like.errors import ConfigError


def host_port(host: str, port: int) -> str:
    """host:port with IPv6 hosts bracketed, as sglang's dist_init_addr expects."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _size(name: str, overrides: Mapping[str, Any], flags: Mapping[str, Any]) -> int:
    value = overrides.get(name, flags.get(name))
    return 1 if value is None else int(value)


def engine_server_args(engine: EnginePlacement, args: argparse.Namespace, *, port: int,
                       nccl_port: int | None = None, dist_init_port: int | None = None,
                       bootstrap_port: int | None = None, model_path: str | None = None,
                       api_key: str | None = None,
                       admin_api_key: str | None = None) -> ComposedArgs:
    """The composed server args of one engine actor (ports: what its actor reserved).

    `model_path` replaces the placement's (e.g. the tiny model the job made for the
    reference engine). `dist_init_port` is reserved by the node_rank-0 actor of a multi-node
    engine and shared with the others.
    """
    path = model_path or engine.model_path
    if path is None:
        raise ConfigError("--hf-checkpoint", f"engine {engine.engine_id} has no model to load")
    if engine.nnodes > 1 and dist_init_port is None:
        raise ConfigError("dist_init_port", f"engine {engine.engine_id} spans {engine.nnodes} "
                                            "nodes and needs the port its node_rank 0 reserved")
    flags = args.sglang_flags
    forced = forced_server_args(
        model_path=path, host=engine.node_ip, port=port, nccl_port=nccl_port,
        num_gpus_per_engine=engine.num_gpus,
        pp_size=_size("pp_size", engine.overrides, flags),
        dp_size=_size("dp_size", engine.overrides, flags),
        ep_size=_size("ep_size", engine.overrides, flags),
        nnodes=engine.nnodes, node_rank=engine.node_rank,
        dist_init_addr=(host_port(engine.dist_init_host, dist_init_port)
                        if engine.dist_init_host and dist_init_port is not None else None),
        base_gpu_id=engine.base_gpu_id, seed=args.seed, engine_rank=engine.engine_index,
        # Only engines on the trainer's GPUs give their memory back (slime's needs_offload).
        enable_memory_saver=bool(args.offload_rollout and engine.shares_trainer_gpus),
        api_key=api_key, admin_api_key=admin_api_key,
        disaggregation_bootstrap_port=bootstrap_port if engine.worker_type == "prefill" else None,
    )
    return compose_server_args(forced=forced, sglang_flags=flags, overrides=engine.overrides,
                               worker_type=engine.worker_type,
                               overrides_path=f"{engine.group_where}.overrides")


def engine_argv(engine: EnginePlacement, args: argparse.Namespace, **kw: Any) -> list[str]:
    """The command line of one engine actor's server, for `--engine sglang|reference`."""
    return render_argv(engine_server_args(engine, args, **kw).args, args.engine)
