"""Trainer ranks of the fsdp tests: PolicyTrainer in spawned processes over real gloo groups."""

from __future__ import annotations

import io
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from slime_like.trainer.checkpoint import load_sharded_rank_state, save_sharded_rank_state
from slime_like.trainer.policy import PolicyTrainer

BATCHES = [
    ([([3, 4, 5], [6, 7, 8]), ([9, 10], [11, 12, 13]), ([14], [15, 16]), ([2, 3], [4])],
     [1.0, -1.0, 0.5, -0.5]),
    ([([20, 21, 22], [23]), ([5, 6], [7, 8, 9, 10]), ([30], [31, 32]), ([1, 2, 3], [4, 5])],
     [-1.0, 1.0, 1.0, -1.0]),
]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _state(policy: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW moments as full tensors."""
    out = {}
    for name, p in policy.model.named_parameters():
        out[name] = _full(p)
        for key, value in policy.optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                out[f"{name}:{key}"] = _full(value)
    return out


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))


def ddp_and_fsdp_rank(rank: int, world: int, ports: tuple[int, int], model_dir: str, steps: int,
                      ckpt: str, out) -> None:
    """Train ddp and fsdp side by side on this rank's share; save the fsdp one (DCP); rank 0
    then resumes it alone (world size 1) and reports what it saw."""
    _init(rank, world, ports[0])
    ddp = PolicyTrainer(model_dir, lr=1e-2, seed=7, group=dist.group.WORLD, backend="ddp")
    fsdp = PolicyTrainer(model_dir, lr=1e-2, seed=7, group=dist.group.WORLD, backend="fsdp")
    curves: dict[str, list[tuple[float, float]]] = {"ddp": [], "fsdp": []}
    for k in range(steps):
        samples, adv = BATCHES[k % len(BATCHES)]
        for name, policy in (("ddp", ddp), ("fsdp", fsdp)):
            m = policy.train_step(samples[rank::world], adv[rank::world])
            curves[name].append((m["loss"], m["grad_norm"]))
    probe = [s for s, _ in BATCHES[0][0]]
    logprobs = {"ddp": ddp.completion_logprobs(BATCHES[0][0]),
                "fsdp": fsdp.completion_logprobs(BATCHES[0][0])}
    states = {"ddp": _state(ddp), "fsdp": _state(fsdp)}
    save_sharded_rank_state(fsdp.model, fsdp.optimizer, rank, ckpt)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return
    _init(0, 1, ports[1])
    resumed = PolicyTrainer(model_dir, lr=1e-2, seed=99, group=dist.group.WORLD, backend="fsdp")
    load_sharded_rank_state(resumed.model, resumed.optimizer, 0, ckpt)
    states["resumed"] = _state(resumed)
    logprobs["resumed"] = resumed.completion_logprobs(BATCHES[0][0])
    buf = io.BytesIO()  # bytes, not shared-memory tensors: this process exits right after
    torch.save({"curves": curves, "states": states, "logprobs": logprobs, "probe": probe}, buf)
    out.put(buf.getvalue())
    dist.destroy_process_group()
