"""The dtype the engines serve, and the trainer's weights cast to it for a sync.

The trainer keeps fp32 weights (and optimizer states); engines serve the checkpoint's dtype
(bf16 for most HF checkpoints) unless `--sglang-dtype` says otherwise. A sync must send
exactly the engines' dtype, so the model is cast one tensor at a time while buckets are
packed, never as a second full copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from slime_like.protocol.buckets import TensorMeta, dtype_from_name
from slime_like.weights.source import ModelWeights

_SGLANG_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _checkpoint_dtype_name(model_path: str | Path) -> str | None:
    config = Path(model_path) / "config.json"
    if config.is_file():
        raw = json.loads(config.read_text())
    else:  # a hub id: transformers resolves it (and it is cached by the job's preflight)
        from transformers import AutoConfig

        raw = AutoConfig.from_pretrained(str(model_path)).to_dict()
    value = raw.get("torch_dtype") or raw.get("dtype")
    return str(value).removeprefix("torch.") if value else None


def serve_dtype(model_path: str | Path, engine_dtype: str | None = None) -> torch.dtype:
    """The engines' dtype: `engine_dtype` (sglang's --dtype) unless 'auto', else the
    checkpoint's (float32 when it names none)."""
    name = engine_dtype if engine_dtype not in (None, "auto") else _checkpoint_dtype_name(
        model_path)
    name = _SGLANG_ALIASES.get(name or "float32", name or "float32")
    return dtype_from_name(name)


class CastWeights:
    """A model's weights (HF names, LoRA merged) as `dtype`: floating tensors cast lazily."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.inner = ModelWeights(model)
        self.dtype = dtype
        self._metas = [TensorMeta(m.name, dtype if m.dtype.is_floating_point else m.dtype,
                                  m.shape) for m in self.inner.metadata()]

    def metadata(self) -> list[TensorMeta]:
        return self._metas

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.inner.tensors():
            yield name, t.to(self.dtype) if t.is_floating_point() else t
