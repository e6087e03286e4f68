"""Cross-flag rules, checked after parsing and before any GPU is allocated.

Resolves the values other flags imply (offload under --colocate, --rollout-num-gpus,
the weight transport), attaches the resolved `topology`, and dry-runs placement on the
nominal cluster (nodes of --num-gpus-per-node GPUs) so misaligned groups fail here.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from slime_like.config.async_flags import resolve_async
from slime_like.config.chaos_flags import check_chaos
from slime_like.config.flags import SLIME_TRANSPORT
from slime_like.config.layout import layout_from_args, nominal_bundles, plan_job
from slime_like.config.passthrough import OWNED_ROUTER_FIELDS
from slime_like.config.rl_flags import check_dynamic_sampling, resolve_off_policy
from slime_like.config.slices import RolloutSettings
from slime_like.config.topology import resolve_topology
from slime_like.errors import ConfigError
from slime_like.protocol.flag_tables import DEFAULT_ROUTER, ROUTER_TABLES
from slime_like.protocol.flag_tables import router_table as router_arg_table
from slime_like.protocol.modes import AsyncMode, Transport

logger = logging.getLogger(__name__)


def _exclusive(args: argparse.Namespace) -> None:
    pairs = [
        ("sglang_config", "--sglang-config", "prefill_num_servers", "--prefill-num-servers",
         "describe prefill and decode groups in the YAML instead"),
        ("sglang_config", "--sglang-config", "rollout_external_engine_addrs",
         "--rollout-external-engine-addrs", "external engines are not placed"),
        ("prefill_num_servers", "--prefill-num-servers", "rollout_external_engine_addrs",
         "--rollout-external-engine-addrs", "external engines are not placed"),
        ("debug_rollout_only", "--debug-rollout-only", "debug_train_only",
         "--debug-train-only", "pick one"),
        ("rollout_external_engine_addrs", "--rollout-external-engine-addrs", "colocate",
         "--colocate", "external engines cannot share the trainer's GPUs"),
    ]
    for a, a_flag, b, b_flag, why in pairs:
        if getattr(args, a) not in (None, False) and getattr(args, b) not in (None, False):
            raise ConfigError(a_flag, f"cannot be combined with {b_flag} ({why})")


def _refuse_unsupported(args: argparse.Namespace) -> None:
    """Flags slime has whose mode this job does not run: refused, never silently ignored."""
    refused = [
        ("debug_train_only", "--debug-train-only",
         "not supported: the job trains on samples the engines generate"),
        ("sglang_router_ip", "--sglang-router-ip",
         "attaching to a router the job does not own is not supported (the fleet alone adds "
         "and removes workers); drop it, --sglang-router-port fixes our router's port"),
    ]
    for name, flag, why in refused:
        if getattr(args, name) not in (None, False):
            raise ConfigError(flag, why)


def _resolve_offload(args: argparse.Namespace) -> None:
    # slime: --colocate and --offload imply both offloads unless a flag says otherwise.
    implied = args.colocate or args.offload
    for name, flag in (("offload_train", "--offload-train"),
                       ("offload_rollout", "--offload-rollout")):
        if getattr(args, name) is None:
            setattr(args, name, bool(implied))
        elif getattr(args, name) and not args.colocate:
            raise ConfigError(flag, "only with --colocate (engines on their own GPUs have "
                                    "nothing to give the trainer)")
    if args.offload_rollout and args.update_weights_interval > 1 and \
            not args.sglang_flags.get("enable_weights_cpu_backup"):
        raise ConfigError("--update-weights-interval", "> 1 with --offload-rollout needs "
                                                       "--sglang-enable-weights-cpu-backup "
                                                       "(released weights come back only with "
                                                       "the next sync, so engines would sit "
                                                       "idle until then)")
    if args.offload_train_weights is None:
        args.offload_train_weights = True
    elif not args.offload_train:
        flag = "--offload-train-weights" if args.offload_train_weights else \
            "--no-offload-train-weights"
        raise ConfigError(flag, "only with --offload-train (it says whether the trainer's "
                                "weights move when its state does)")
    if args.offload and not args.colocate:
        raise ConfigError("--offload", "only with --colocate (engines on their own GPUs have "
                                       "nothing to give the trainer)")


def _check_kl(args: argparse.Namespace, topology) -> None:
    wants = [(flag, on) for flag, on in (("--use-kl-loss", args.use_kl_loss),
                                          ("--kl-coef", args.kl_coef > 0)) if on]
    if args.use_kl_loss and args.kl_loss_coef <= 0:
        raise ConfigError("--kl-loss-coef", "must be > 0 with --use-kl-loss")
    if not args.use_kl_loss and args.kl_loss_coef > 0:
        raise ConfigError("--kl-loss-coef", "has no effect without --use-kl-loss")
    if wants and not any(not m.update_weights for m in topology.models):
        raise ConfigError(wants[0][0], "needs a reference model: a model with update_weights: "
                                       "false in --sglang-config")


def _check_engines(args: argparse.Namespace, topology) -> None:
    if args.rollout_external_engine_addrs and not args.use_fault_tolerance:
        raise ConfigError("--rollout-external-engine-addrs", "needs --use-fault-tolerance (no "
                                                             "process of ours reports an "
                                                             "external engine's death: only "
                                                             "probes see it)")
    if topology.num_gpus == 0 and not args.rollout_external_engine_addrs:
        raise ConfigError("--rollout-num-gpus", "0 leaves the job without engines; give "
                                                "--rollout-external-engine-addrs or GPUs")


def _resolve_rollout_gpus(args: argparse.Namespace) -> None:
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.rollout_num_gpus is not None or args.sglang_config is not None:
        return  # with --sglang-config an unset value becomes the YAML's sum (below)
    if args.colocate:
        args.rollout_num_gpus = actor_gpus
    elif args.rollout_external_engine_addrs or args.debug_train_only:
        args.rollout_num_gpus = 0
    else:
        raise ConfigError("--rollout-num-gpus", "required: the GPUs of all rollout engines "
                                                "(0 starts routers without engines), unless "
                                                "--colocate or --sglang-config gives it")


def _check_sizes(args: argparse.Namespace) -> None:
    if args.actor_num_gpus_per_node > args.num_gpus_per_node and not args.debug_rollout_only:
        raise ConfigError("--actor-num-gpus-per-node",
                          f"must be <= --num-gpus-per-node ({args.num_gpus_per_node}), got "
                          f"{args.actor_num_gpus_per_node}")


def check_addresses(addrs: Sequence[str]) -> None:
    """Every external engine's address is HOST:PORT."""
    for addr in addrs:
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("--rollout-external-engine-addrs",
                              f"expected HOST:PORT for each engine, got {addr!r}")


def _resolve_transport(args: argparse.Namespace) -> None:
    if args.update_weight_transport == SLIME_TRANSPORT:
        args.update_weight_transport = Transport.TENSOR if args.colocate else Transport.DISTRIBUTED
    args.update_weight_transport = Transport(args.update_weight_transport)
    if args.update_weight_mode == "delta" and args.update_weight_transport == Transport.TENSOR:
        raise ConfigError("--update-weight-mode", "delta updates run over the disk and "
                          "distributed transports; the tensor transport (--colocate) shares "
                          "the trainer's memory, so there are no bytes to save")
    if args.update_weight_transport == Transport.DISK and not args.update_weight_disk_dir:
        raise ConfigError("--update-weight-disk-dir",
                          "required with --update-weight-transport disk (a directory both the "
                          "trainer and every engine can read)")


def _check_train_backend(args: argparse.Namespace) -> None:
    if args.train_backend == "fsdp" and args.update_weights_interval > 1:
        raise ConfigError("--update-weights-interval", "> 1 with --train-backend fsdp: a "
                                                       "sharded trainer keeps no copy of the "
                                                       "served weights between syncs")
    if args.train_backend == "fsdp" and args.async_mode != AsyncMode.SYNC:
        raise ConfigError("--train-backend", f"fsdp with --async-mode {args.async_mode}: a "
                                             "sharded trainer keeps no copy of earlier "
                                             "versions to check stale samples against")


def _check_quantization(args: argparse.Namespace) -> None:
    """--sglang-quantization: fp8 is the one the trainer's syncs can quantize for."""
    value = args.sglang_flags.get("quantization")
    if value is None:
        return
    if value != "fp8":
        raise ConfigError("--sglang-quantization", f"{value!r}: the trainer's weight syncs "
                                                   "quantize for fp8 (sglang's 128x128 block "
                                                   "FP8) only")
    if args.train_backend == "fsdp":
        raise ConfigError("--sglang-quantization", "fp8 with --train-backend fsdp: the "
                                                   "quantized sync runs from a full replica")
    if args.engine == "sglang" and not args.rollout_external_engine_addrs:
        raise ConfigError("--sglang-quantization", "fp8 with --engine sglang: sglang builds "
                                                   "block-FP8 layers only from a block-FP8 "
                                                   "checkpoint, and the job starts trainer and "
                                                   "engines from one --hf-checkpoint (the "
                                                   "reference engine quantizes at load)")


def _check_checkpointing(args: argparse.Namespace) -> None:
    if args.save_interval is not None and not args.save:
        raise ConfigError("--save-interval", "needs --save (the directory to save into)")


def check_router_flags(kind: str, flags: Mapping[str, Any],
                       owned: Mapping[str, str] = OWNED_ROUTER_FIELDS) -> None:
    """Owned fields are refused; so is a flag or choice the chosen router does not have
    (the job's `--router-*` flags and `slime_like.api`'s `RouterSettings.flags` alike)."""
    for name, why in owned.items():
        if name in flags:
            raise ConfigError("--router-" + name.replace("_", "-"), f"not settable: {why}")
    table = router_arg_table(kind)
    for name, value in flags.items():
        flag = "--router-" + name.replace("_", "-")
        if name not in table:
            others = [k for k in ROUTER_TABLES if k != kind and name in router_arg_table(k)]
            raise ConfigError(flag, f"{kind} {table.version} has no such flag"
                              + (f"; it is a flag of {others[0]} (--router {others[0]})"
                                 if others else ""))
        spec = table[name]
        if name == "policy" and value == "power_of_two":
            raise ConfigError(flag, "power_of_two: both routers refuse to start with it and "
                                    "fewer than 2 workers, and slime_like starts its routers "
                                    "empty (engines are added as they become healthy); use "
                                    "least_load (--router smg), cache_aware or round_robin")
        if spec.choices and value not in spec.choices:
            others = [k for k in ROUTER_TABLES if k != kind and name in router_arg_table(k)
                      and value in (router_arg_table(k)[name].choices or ())]
            raise ConfigError(flag, f"{value!r} is not one of {kind}'s {list(spec.choices)}"
                              + (f"; {others[0]} has it (--router {others[0]})"
                                 if others else ""))


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check cross-flag rules, fill implied values, attach `args.topology` and `args.plan`."""
    _exclusive(args)
    _refuse_unsupported(args)
    _resolve_offload(args)
    resolve_async(args)
    _check_sizes(args)
    check_router_flags(getattr(args, "router", None) or DEFAULT_ROUTER, args.router_flags)
    check_addresses(args.rollout_external_engine_addrs or ())
    _resolve_transport(args)
    _check_checkpointing(args)
    resolve_off_policy(args)
    check_dynamic_sampling(args, args.rollout_batch_size or RolloutSettings.batch_size)
    _check_train_backend(args)
    _check_quantization(args)
    check_chaos(args)
    _resolve_rollout_gpus(args)
    if args.reference_min_step_ms and args.engine != "reference":
        raise ConfigError("--reference-min-step-ms", f"only the reference engine has it "
                                                     f"(--engine is {args.engine})")
    if args.engine == "sglang" and args.hf_checkpoint is None and \
            not args.rollout_external_engine_addrs and args.sglang_config is None:
        raise ConfigError("--hf-checkpoint", "required with --engine sglang (the checkpoint "
                                             "the engines serve and the trainer updates)")
    topology = resolve_topology(args)
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = topology.num_gpus
    for warning in topology.warnings:
        logger.warning("%s", warning)
    _check_engines(args, topology)
    _check_kl(args, topology)
    args.topology = topology
    layout = layout_from_args(args)
    # Dry run on the nominal cluster: misaligned groups fail before any GPU is allocated.
    args.nominal_plan = plan_job(topology, nominal_bundles(layout.num_bundles,
                                                           args.num_gpus_per_node), layout)
    return args
