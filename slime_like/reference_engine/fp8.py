"""`--quantization fp8`: the engine serves its linear projections as FP8 blocks.

Each quantized projection (`protocol/fp8.py`: attention q/k/v/o, MLP and expert
gate/up/down) becomes an `Fp8Linear` holding sglang's two parameters, `weight` (e4m3) and
`weight_scale_inv` (float32, one per 128x128 block), under the same HF names a block-FP8
checkpoint and a quantizing trainer use; so updates, load plans, checksums and
`/get_weights_by_name` need nothing new. On a CPU the matmul dequantizes the weight to the
activations' dtype first (sglang's GPU kernels multiply the blocks' scales inside the GEMM;
the product is the same weight). The engine starts from the checkpoint's full-precision
weights quantized at load, as sglang's `--quantization fp8` does for an unquantized
checkpoint (in block layout here, so that every update has the layout trainers send).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slime_like.errors import ConfigError
from slime_like.protocol import fp8


class Fp8Linear(nn.Module):
    """A linear layer whose weight is FP8 blocks; dequantized at each matmul."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 block: tuple[int, int] = fp8.BLOCK):
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(values, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear, block: tuple[int, int] = fp8.BLOCK) -> Fp8Linear:
        values, scale = fp8.quantize(linear.weight.detach(), block)
        return cls(values, scale, None if linear.bias is None else linear.bias.detach(), block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = fp8.dequantize(self.weight, self.weight_scale_inv, x.dtype, self.block)
        return F.linear(x, weight, self.bias)


def check_tp_split(model: nn.Module, tp_size: int) -> None:
    """Refuse, as sglang does at load, a TP size that would split a block between ranks."""
    problems = fp8.block_split_problems(
        ((name, tuple(p.shape)) for name, p in model.named_parameters()), tp_size)
    if problems:
        raise ConfigError("--tp-size", f"{tp_size} splits FP8 blocks (--quantization fp8, "
                                       f"{fp8.BLOCK[0]}x{fp8.BLOCK[1]}): " + "; ".join(problems[:3])
                          + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))


@torch.no_grad()
def quantize_model(model: nn.Module, tp_size: int = 1) -> nn.Module:
    """Replace every quantized projection of a loaded model by its `Fp8Linear`, in place,
    after checking that `tp_size` ranks would each hold whole blocks."""
    check_tp_split(model, tp_size)
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and fp8.is_quantized(f"{name}.weight")]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, Fp8Linear.of(module))
    return model
