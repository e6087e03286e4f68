"""First-attach handshake: what parameters an engine's model has, to check before sending.

sglang has no endpoint listing parameter names, dtypes and shapes (`/weights_checker`
names are the engine's internal, TP-sharded ones; `/get_weights_by_name` returns values,
one tensor per call). What every engine does report is its checkpoint (`/model_info`
`model_path`) and dtype (`/server_info` `dtype`). When this host can read that checkpoint's
config.json and the architecture is one we implement (Llama, Qwen3, Qwen3-MoE, the same
classes the reference engine serves), the expected HF names and shapes come from building
the model on the meta device: exact, no weights read, no GPU touched. Otherwise the check is
skipped with one warning naming the engine and why, and the sync still verifies metadata
against what was registered at attach.
"""

from __future__ import annotations

import torch

from slime_like.engine.session import EngineSession
from slime_like.errors import ConfigError, WeightMetadataError
from slime_like.models.config import ModelConfig
from slime_like.models.transformer import CausalLM, hf_named_parameters
from slime_like.protocol.buckets import TensorMeta, dtype_from_name, dtype_name
from slime_like.protocol.fp8 import quantized_metadata


def engine_model_metadata(engine: EngineSession) -> tuple[list[TensorMeta] | None, str, str]:
    """(expected metadata or None, model_path, why it is None) for one engine."""
    path = str(engine.model_info().get("model_path") or "")
    try:
        config = ModelConfig.from_pretrained(path)
    except ConfigError as e:
        return None, path, str(e)
    except OSError as e:
        return None, path, f"cannot read {path}: {e}"
    dtype_text = str(engine.server_info.get("dtype") or "auto")
    dtype_text = {"half": "float16", "float": "float32"}.get(dtype_text, dtype_text)
    try:
        dtype = config.dtype if dtype_text == "auto" else dtype_from_name(dtype_text)
    except ValueError as e:
        return None, path, f"unknown engine dtype: {e}"
    with torch.device("meta"):
        model = CausalLM(config, init_weights=False)
    metas = [TensorMeta(n, dtype, tuple(prm.shape)) for n, prm in hf_named_parameters(model)]
    if engine.server_info.get("quantization") == "fp8":  # sglang's block layout (protocol/fp8)
        metas = quantized_metadata(metas, dtype)
    return metas, path, ""


def check_same_metadata(expected: list[TensorMeta], actual: list[TensorMeta],
                        where: str = "the weights passed to this sync",
                        against: str = "the registered metadata", subset: bool = False,
                        engine: str | None = None) -> None:
    """Raise WeightMetadataError listing every difference (missing, extra, dtype, shape).

    Order does not matter (buckets are planned from `actual`); with `subset`, names of
    `expected` that `actual` lacks are fine (a sync may update part of a model).
    """
    exp = {m.name: m for m in expected}
    act = {m.name: m for m in actual}
    problems = [] if subset else [f"missing {n!r}" for n in exp if n not in act]
    problems += [f"unexpected {n!r}" for n in act if n not in exp]
    for n, m in act.items():
        e = exp.get(n)
        if e is not None and e.dtype != m.dtype:
            problems.append(f"{n!r}: dtype {dtype_name(m.dtype)}, expected {dtype_name(e.dtype)}")
        if e is not None and e.shape != m.shape:
            problems.append(f"{n!r}: shape {list(m.shape)}, expected {list(e.shape)}")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise WeightMetadataError(f"{where} disagree with {against}: "
                                  + "; ".join(problems[:8]) + more, engine=engine)
