"""`--hf-checkpoint`: resolve it before any engine starts, and load it with `transformers`.

A value is either a local directory with a `config.json` or a Hugging Face hub id whose
`config.json` can be fetched (from the local cache, or the hub when online). Anything else
fails at once with one line naming the flag, instead of after the engines started.
"""

from __future__ import annotations

from pathlib import Path

import requests
import torch
from torch import nn

from slime_like.errors import ConfigError

FLAG = "--hf-checkpoint"


def _looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "~"))


def check_checkpoint(value: str, flag: str = FLAG, *, offline_ok: bool = False,
                     warnings: list[str] | None = None) -> str:
    """'local' or 'hub' if `value` names a loadable checkpoint; ConfigError otherwise.

    A hub id is looked up in the local cache first, then asked of the hub once (no
    retries). With `offline_ok` (a dry run, which does not need the files) a hub that
    cannot be reached now is a warning appended to `warnings`, not an error; a hub that
    answers that the repository does not exist is an error either way.
    """
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(flag, f"{value} is a directory without a config.json (not an HF "
                                    "checkpoint)")
        return "local"
    if not _looks_like_hub_id(value):
        raise ConfigError(flag, f"{value!r} is neither a local directory with a config.json "
                                "nor a Hugging Face hub id (org/name)")
    reachable, reason = _on_the_hub(value, flag)
    if reachable:
        return "hub"
    if offline_ok:
        message = (f"{flag}: {value!r} is not in the local Hugging Face cache and the hub "
                   f"cannot be reached now ({reason}); the job will need it: network access "
                   f"to the hub, or `huggingface-cli download {value}` beforehand, or a local "
                   "directory")
        if warnings is not None:
            warnings.append(message)
        return "hub"
    raise ConfigError(flag, f"{value!r} is not a local directory and cannot be resolved on "
                            f"the Hugging Face hub: {reason} (download it where the hub can be "
                            f"reached, `huggingface-cli download {value}`, or pass a local "
                            "directory)")


def _on_the_hub(value: str, flag: str) -> tuple[bool, str]:
    """(True, "") if the checkpoint's config.json is cached or on the hub; else (False, why
    it cannot be reached now). ConfigError if the hub answers that it does not exist.

    One HEAD request with a deadline and no retries (the library's own downloads retry a
    dead network for ~20 s).
    """
    try:
        from huggingface_hub import constants, get_token, hf_hub_url, try_to_load_from_cache
    except ImportError as e:
        raise ConfigError(flag, f"{value!r} is not a local directory, and huggingface_hub is "
                                "not installed to resolve it as a hub id") from e
    if isinstance(try_to_load_from_cache(value, "config.json"), str):
        return True, ""
    if constants.HF_HUB_OFFLINE:
        return False, "HF_HUB_OFFLINE is set and it is not in the cache"
    token = get_token()
    try:
        answer = requests.head(hf_hub_url(value, "config.json"), timeout=5,
                               allow_redirects=False,
                               headers={"authorization": f"Bearer {token}"} if token else {})
    except requests.RequestException as e:  # no network, a proxy refusing, a timeout, ...
        return False, (str(e).splitlines()[0] if str(e) else type(e).__name__)
    code = answer.headers.get("X-Error-Code", "")
    if code == "GatedRepo":
        return True, ""  # it exists; the job needs a token with access (HF_TOKEN)
    if code in ("RepoNotFound", "EntryNotFound", "RevisionNotFound") or answer.status_code == 404:
        raise ConfigError(flag, f"{value!r} is not a local directory and cannot be resolved on "
                                f"the Hugging Face hub: HTTP {answer.status_code} "
                                f"{code or 'not found'}")
    if answer.status_code >= 400:
        return False, f"the hub answered HTTP {answer.status_code} {code}".rstrip()
    return True, ""


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
