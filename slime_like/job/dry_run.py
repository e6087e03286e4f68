"""`slime-like train --dry-run`: the resolved server groups and their nominal placement."""

from __future__ import annotations

import shlex

from slime_like.config.layout import EnginePlacement
from slime_like.config.slices import DryRunSettings
from slime_like.engine.from_placement import engine_argv

# Ports are reserved on each engine's node at launch; the printed lines use these stand-ins.
NOMINAL_PORT = 30000


def describe(settings: DryRunSettings) -> str:
    """The resolved server groups and their nominal placement, for `--dry-run`."""
    plan = settings.plan
    lines = [f"placement group: {plan.layout.num_bundles} bundles of {{GPU: 1, CPU: 1}}; "
             f"trainer ranks: {len(plan.trainer)}; rollout from slot {plan.layout.rollout_offset}"
             f" (nodes of {settings.gpus_per_node} GPUs assumed)"]
    for model in settings.topology.models:
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
            lines.append("      $ " + shlex.join(_argv(e, settings, e.engine_index)))
    for addr in settings.external_addrs:
        lines.append(f"external engine {addr}: attached (checked against /server_info), never "
                     "launched or killed")
    for where, start, n in plan.reserved_slots:
        lines.append(f"reserved by {where}: slots {start}..{start + n - 1}")
    return "\n".join(lines)


def _argv(e: EnginePlacement, settings: DryRunSettings, i: int) -> list[str]:
    """The engine's server command line, with stand-in ports (the job reserves real ones)."""
    base = NOMINAL_PORT + 10 * i
    model_path = None if e.model_path else "<tiny model made by the job>"
    return engine_argv(e, settings.engine, port=base, nccl_port=base + 1,
                       dist_init_port=base + 2 if e.nnodes > 1 else None,
                       bootstrap_port=base + 3, model_path=model_path)
