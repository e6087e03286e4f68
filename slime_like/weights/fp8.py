"""FP8 rollout from a full-precision trainer: what a quantized sync sends, and the weights
the engines then compute with.

`Fp8Weights` is the sync's source when the engines run `--quantization fp8`: every quantized
projection (`protocol/fp8.py`) is block-quantized on the trainer's device as the buckets
are packed, one tensor at a time (the previous bucket is on the wire meanwhile), and sent
as sglang's two tensors, `<name>` (e4m3) and `<name>_scale_inv` (float32); the other
tensors go in the engines' dtype, as `CastWeights` sends them. No second copy of the model
is made for the send.

`ServedWeights` is what the trainer checks the engines against: a frozen copy of the model
holding exactly what the engines hold after the sync, dequantized (values x block scale,
in the trainer's dtype, as the engine's matmul does) and the unquantized tensors cast to the
engines' dtype and back. Quantization is deterministic (same weights, same function, same
device: the same bytes), so the copy is rebuilt from the trainer's weights after the sync
rather than kept from the send.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import torch
from torch import nn

from slime_like.protocol import fp8
from slime_like.protocol.buckets import TensorMeta
from slime_like.weights.packing import ModelWeights


class Fp8Weights:
    """A model's weights in sglang's FP8 block layout: a `WeightSource`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype,
                 block: tuple[int, int] = fp8.BLOCK):
        self.inner = ModelWeights(model)
        if self.inner.resident() is None:
            raise ValueError("FP8 syncs of a LoRA model are not supported: merge the adapters "
                             "first (the quantized weight must be the merged one)")
        self.dtype = dtype
        self.block = block
        self._metas = fp8.quantized_metadata(self.inner.metadata(), dtype, block)
        self.quantize_s = 0.0  # the last sync's time spent quantizing (trainer's clock)

    def metadata(self) -> list[TensorMeta]:
        return self._metas

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.quantize_s = 0.0
        for name, t in self.inner.tensors():
            if fp8.is_quantized(name) and t.dim() == 2:
                started = time.perf_counter()
                values, scale = fp8.quantize(t, self.block)
                self.quantize_s += time.perf_counter() - started
                yield name, values
                yield fp8.scale_name(name), scale
            else:
                yield name, t.to(self.dtype) if t.is_floating_point() else t


class ServedWeights:
    """A frozen copy of the model with the weights the engines serve after an FP8 sync."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, block: tuple[int, int] = fp8.BLOCK):
        self.source = ModelWeights(model)
        self.dtype = dtype
        self.block = block
        self._copy: nn.Module | None = None

    @torch.no_grad()
    def refresh(self) -> nn.Module:
        """The copy, set to what the engines hold for the trainer's current weights."""
        if self._copy is None:
            self._copy = copy.deepcopy(self.source.model)
            self._copy.requires_grad_(False)
            self._copy.eval()
        params = dict(self._copy.named_parameters())
        for name, t in self.source.tensors():
            target = params[name]
            if fp8.is_quantized(name) and t.dim() == 2:
                values, scale = fp8.quantize(t, self.block)
                target.copy_(fp8.dequantize(values, scale, target.dtype, self.block))
            elif t.is_floating_point():
                target.copy_(t.to(self.dtype).to(target.dtype))
        return self._copy
