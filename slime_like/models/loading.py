"""Build, load, initialise and save models by HF parameter name."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slime_like.errors import ConfigError
from slime_like.models.config import ModelConfig
from slime_like.models.transformer import CausalLM, hf_named_parameters


def build_model(config: ModelConfig, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> CausalLM:
    """An uninitialised model allocated straight on `device` (no CPU detour for big layouts)."""
    with torch.device("meta"):
        model = CausalLM(config, init_weights=False)
    # Cast while still on meta (free): casting after allocation would hold a float32 copy
    # (2x the bf16 bytes) and leave it fragmented in the CUDA caching allocator.
    # `to_empty` would do, but its `empty_like` of a meta tensor imports sympy (0.3 s at
    # every engine's and trainer's start); `empty_strided` allocates the same storage.
    model = model.to(dtype or config.dtype)._apply(lambda t: torch.empty_strided(
        t.size(), t.stride(), dtype=t.dtype, device=device))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights from the config alone, like sglang's `--load-format dummy`."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in hf_named_parameters(model):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of an HF checkpoint (single file or sharded with an index)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / f for f in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(str(model_dir), "no *.safetensors checkpoint in the model directory")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, one file open at a time."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_weights(model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 *, strict_names: bool = True) -> list[str]:
    """Copy tensors into the parameters of the same HF name; returns the names loaded.

    A name the model does not have, or a shape that differs, raises before anything
    later in the list is copied; the message names the tensor.
    """
    params = dict(model.named_parameters())
    # Some checkpoints store a tied lm_head anyway; it is the embedding parameter here.
    if model.config.tie_word_embeddings:
        params.setdefault("lm_head.weight", model.lm_head.weight)
    loaded = []
    for name, tensor in named_tensors:
        param = params.get(name)
        if param is None:
            if strict_names:
                raise KeyError(f"unknown parameter {name!r} for {model.config.architecture}")
            continue
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"shape mismatch for {name!r}: model has {tuple(param.shape)}, got {tuple(tensor.shape)}"
            )
        param.copy_(tensor)
        loaded.append(name)
    return loaded


def load_checkpoint(model: CausalLM, model_dir: str | Path) -> None:
    """Load every parameter from an HF checkpoint; a missing parameter is an error."""
    loaded = set(load_weights(model, iter_checkpoint(model_dir)))
    missing = [n for n, _ in hf_named_parameters(model) if n not in loaded]
    if missing:
        raise ConfigError(str(model_dir), f"checkpoint lacks parameters {missing[:5]}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_pretrained(model_dir: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, load_format: str = "auto",
                    seed: int = 0) -> CausalLM:
    """config.json + weights (or random weights for load_format 'dummy') -> model."""
    config = ModelConfig.from_pretrained(model_dir)
    model = build_model(config, device=device, dtype=dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_checkpoint(model, model_dir)
    return model


def save_state_dict_atomic(state: dict[str, torch.Tensor], out_dir: str | Path,
                           extra_files: dict[str, str] | None = None) -> Path:
    """Write model.safetensors (+ extra text files) into `out_dir` atomically.

    Files go to a temporary sibling directory that is renamed into place, so a reader
    never sees a half-written checkpoint.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
