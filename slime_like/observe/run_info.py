"""What a run folder keeps besides its metrics: the resolved flags, versions, git revision.

A run is reproducible only if its folder says exactly what ran: every flag after `--config`
files and defaults were applied, the versions of the packages that matter, and the
revision of this code.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib.metadata
import importlib.util
import json
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime_like.router.kinds import router_kind

PACKAGES = ("torch", "ray", "sglang-router", "smg", "slime_like")
UNKNOWN = "unknown"


def json_safe(value: Any) -> Any:
    """`value` as plain JSON types; objects without a JSON form become their repr."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return json_safe(value.value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((json_safe(v) for v in value), key=repr)
    if hasattr(value, "model_dump"):  # pydantic
        return json_safe(value.model_dump())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_safe({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    return repr(value)


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """python and the packages a bug report needs; sglang only where it is installed."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        out[name] = package_version(name)
    if importlib.util.find_spec("sglang") is not None:
        out["sglang"] = package_version("sglang") or UNKNOWN
    out["git_revision"] = git_revision()
    return out


def git_revision(path: Path | None = None) -> str:
    """Commit of the checkout this package runs from (`+dirty` if modified), else "unknown".

    Only a checkout of this project counts: a site-packages inside some other repository
    (a venv in a project folder) must not report that repository's commit.
    """
    where = (path or Path(__file__).resolve().parents[1]).resolve()  # the slime_like package
    try:
        top = subprocess.run(["git", "-C", str(where), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=10)
        if top.returncode != 0 or not (Path(top.stdout.strip()) / "pyproject.toml").is_file() \
                or where.parent != Path(top.stdout.strip()).resolve():
            return UNKNOWN
        rev = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return UNKNOWN
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def router_in_use(args: argparse.Namespace | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """{"name", "version"} of the router the run starts (`--router`), or None without args.

    Both router wheels install an `smg` console script, so the version is read from the
    chosen router's own distribution, never from that script.
    """
    if args is None:
        return None
    name = (vars(args) if isinstance(args, argparse.Namespace) else args).get("router")
    kind = router_kind(name)
    return {"name": kind.name, "version": package_version(kind.distribution)}


def write_run_info(out_dir: Path, args: argparse.Namespace | Mapping[str, Any] | None) -> None:
    """config.json (the resolved flags) and versions.json (with the git revision and, for a
    job, the router it runs)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = versions()
    if args is not None:
        (out_dir / "config.json").write_text(json.dumps(json_safe(args), indent=2) + "\n")
        info["router"] = router_in_use(args)
    (out_dir / "versions.json").write_text(json.dumps(info, indent=2) + "\n")
