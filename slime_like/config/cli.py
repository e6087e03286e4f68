"""`slime-like train`: parse and validate the flags, then run the job (or `--dry-run`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from slime_like.config.parse import parse_args
from slime_like.errors import ConfigError

PROG = "slime-like train"


def describe(args: argparse.Namespace) -> str:
    """The resolved server groups and their nominal placement, for `--dry-run`."""
    plan = args.nominal_plan
    lines = [f"placement group: {plan.layout.num_bundles} bundles of {{GPU: 1, CPU: 1}}; "
             f"trainer ranks: {len(plan.trainer)}; rollout from slot {plan.layout.rollout_offset}"
             f" (nodes of {args.num_gpus_per_node} GPUs assumed)"]
    for model in args.topology.models:
        router = "PD router" if model.pd_disaggregation else "router"
        lines.append(f"model {model.name!r}: {router}, model_path={model.model_path}, "
                     f"update_weights={model.update_weights}")
        for g in model.groups:
            lines.append(f"  {g.where}: {g.worker_type} x{g.num_engines} engines of "
                         f"{g.num_gpus_per_engine} GPUs ({g.num_gpus} GPUs)"
                         + (f", overrides {dict(g.overrides)}" if g.overrides else ""))
        for e in plan.engines_of(model.name):
            lines.append(f"    {e.engine_id} node_rank {e.node_rank}/{e.nnodes}: slot {e.slot}, "
                         f"{e.node_ip} GPUs {e.base_gpu_id}..{e.base_gpu_id + e.gpus_on_node - 1}")
    for where, start, n in plan.reserved_slots:
        lines.append(f"reserved by {where}: slots {start}..{start + n - 1}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point the top-level `slime-like` CLI dispatches `train` to."""
    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(describe(args))
        return 0
    try:
        train = importlib.import_module("slime_like.train")
    except ModuleNotFoundError as e:
        if e.name != "slime_like.train":
            raise
        print(f"{PROG}: error: the training loop (slime_like.train) is not in this build; "
              "--dry-run checks a configuration without it", file=sys.stderr)
        return 2
    try:
        return int(train.train(args) or 0)
    except ConfigError as e:  # e.g. --use-wandb without wandb: found when the job starts
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
