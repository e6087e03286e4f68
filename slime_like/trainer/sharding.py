"""--train-backend fsdp: the policy sharded with FSDP2 over the trainer's process group.

Each decoder layer is one `fully_shard` unit and the root (embeddings, final norm, lm_head)
another, so a forward or backward holds one layer unsharded at a time; parameters, gradients
and the optimizer's state stay sharded (DTensor, Shard(0)). Gradients are averaged over the
ranks by FSDP's reduce-scatter, as the ddp backend's all-reduce does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

BACKENDS = ("ddp", "fsdp")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of our models and of transformers' causal LMs (`model.layers`)."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"--train-backend fsdp: cannot find the decoder layers of a "
                         f"{type(model).__name__} (expected model.layers)")
    return list(layers)


def shard_model(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """FSDP2 `fully_shard` per decoder layer, then the root, over `group` (1-D mesh)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def as_float(value: torch.Tensor) -> float:
    """A scalar that may be a DTensor (e.g. clip_grad_norm_ over sharded gradients)."""
    full = getattr(value, "full_tensor", None)
    return float(full() if callable(full) else value)
