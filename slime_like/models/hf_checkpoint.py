"""`--hf-checkpoint`: resolve it before any engine starts, and load it with `transformers`.

A value is either a local directory with a `config.json` or a Hugging Face hub id whose
`config.json` can be fetched (from the local cache, or the hub when online). Anything else
fails at once with one line naming the flag, instead of after the engines started.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from slime_like.errors import ConfigError

FLAG = "--hf-checkpoint"


def _looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "~"))


def check_checkpoint(value: str, flag: str = FLAG) -> str:
    """'local' or 'hub' if `value` names a loadable checkpoint; ConfigError otherwise."""
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(flag, f"{value} is a directory without a config.json (not an HF "
                                    "checkpoint)")
        return "local"
    if not _looks_like_hub_id(value):
        raise ConfigError(flag, f"{value!r} is neither a local directory with a config.json "
                                "nor a Hugging Face hub id (org/name)")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise ConfigError(flag, f"{value!r} is not a local directory, and huggingface_hub is "
                                "not installed to resolve it as a hub id") from e
    try:
        hf_hub_download(value, "config.json")
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated repo, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(flag, f"{value!r} is not a local directory and cannot be resolved on "
                                f"the Hugging Face hub: {reason}") from e
    return "hub"


def local_checkpoint(value: str, flag: str = FLAG) -> str:
    """A local directory for `value`: itself, or the hub snapshot downloaded to the cache."""
    if check_checkpoint(value, flag) == "local":
        return str(Path(value).expanduser().resolve())
    from huggingface_hub import snapshot_download

    return snapshot_download(value)


def load_transformers_model(model_dir: str | Path, device: str = "cpu",
                            dtype: torch.dtype = torch.float32) -> nn.Module:
    """`AutoModelForCausalLM` from the checkpoint, in `dtype`, eager attention.

    Eager attention keeps the trainer's fp32 logits equal to the reference engine's (SDPA
    kernels may pick a different reduction order on some builds).
    """
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ConfigError(FLAG, "training an HF checkpoint needs transformers "
                                "(pip install 'slime_like[hf]')") from e
    import transformers
    from packaging.version import Version

    # transformers renamed torch_dtype to dtype in 4.56
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager",
                                                 **{key: dtype})
    return model.to(device)
