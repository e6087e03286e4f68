"""The dtype the engines serve: `--sglang-dtype`, else the checkpoint's.

The trainer keeps fp32 weights (and optimizer states); engines serve the checkpoint's dtype
(bf16 for most HF checkpoints) unless `--sglang-dtype` says otherwise. A sync sends exactly
the engines' dtype (`weights.packing.CastWeights`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from slime_like.protocol.buckets import dtype_from_name

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
